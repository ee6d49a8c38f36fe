"""The air gap: hub access off, traffic to non-loopback addresses refused (naming the target) before anything is
sent, name lookups closed except getaddrinfo of loopback names, loopback allowed.

Nothing here may leave the machine even when the guard is broken: the targets are loopback, ``localhost``, names
the C library resolves without a lookup (``127.1``) and TEST-NET-1 / the IPv6 documentation prefix
(192.0.2.1, 2001:db8::1) as addresses the guard must refuse, and a tripwire (a second audit hook, installed after
the guard's, active during these tests) turns any non-loopback connect/send/lookup that got past the guard into an
AssertionError before the system call.
"""

from __future__ import annotations

import _socket
import asyncio
import http.server
import ipaddress
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clef_local import airgap as airgap_module
from clef_local.airgap import airgap, is_local_host, network_state, wants_network
from clef_local.errors import ClefError, NetworkBlockedError

TEST_NET = ("192.0.2.1", 9)  # TEST-NET-1 (RFC 5737): refused by the guard, stopped by the tripwire otherwise
TEST_NET6 = "2001:db8::1"  # the IPv6 documentation prefix (RFC 3849)
_TRIPWIRE = {"on": False, "installed": False}


def _loopback(host: Any) -> bool:
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return host in ("localhost", "127.1")


def _no_lookup(host: Any) -> bool:
    """A host the C library answers without asking anyone: a numeric address or a loopback name."""
    try:
        ipaddress.ip_address(str(host).split("%")[0])
    except ValueError:
        return _loopback(host)
    return True


def _tripwire(event: str, args: tuple[Any, ...]) -> None:
    if not _TRIPWIRE["on"]:
        return
    if event in ("socket.connect", "socket.sendto", "socket.sendmsg"):
        address = args[1]
        if isinstance(address, tuple) and not _loopback(address[0]):
            raise AssertionError(f"tripwire: {event} to {address} got past the guard")
    elif event in ("socket.getaddrinfo", "socket.gethostbyname") and args[0] not in (None, "", b""):
        if not _no_lookup(args[0]):
            raise AssertionError(f"tripwire: {event} of {args[0]!r} got past the guard")
    elif event in ("socket.gethostbyaddr", "socket.getnameinfo"):
        host = args[0][0] if isinstance(args[0], tuple) else args[0]
        if not _loopback(host):
            raise AssertionError(f"tripwire: {event} of {args[0]!r} got past the guard")


@pytest.fixture(autouse=True)
def tripwire() -> Iterator[None]:
    with airgap():  # the guard installs its hook first, so it answers before the tripwire
        pass
    if not _TRIPWIRE["installed"]:
        sys.addaudithook(_tripwire)
        _TRIPWIRE["installed"] = True
    _TRIPWIRE["on"] = True
    try:
        yield
    finally:
        _TRIPWIRE["on"] = False


def test_non_loopback_connections_are_refused_before_connecting():
    original = socket.socket.connect
    with airgap() as state:
        assert state == "off (guard)" and network_state() == "off (guard)"
        assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"
        with pytest.raises(NetworkBlockedError, match=r"192\.0\.2\.1:80"):
            socket.create_connection(("192.0.2.1", 80), timeout=0.1)
        with socket.socket() as s, pytest.raises(NetworkBlockedError, match=r"192\.0\.2\.1:443"):
            s.connect(("192.0.2.1", 443))
        with socket.socket(socket.AF_INET6) as s, pytest.raises(NetworkBlockedError, match=r"2001:db8::1"):
            s.connect_ex((TEST_NET6, 80))
        with socket.socket(socket.AF_INET6) as s, pytest.raises(NetworkBlockedError, match=r"::ffff:192"):
            s.connect(("::ffff:192.0.2.1", 80))  # an IPv4-mapped address is its IPv4 address
        with pytest.raises(urllib.error.URLError) as info:  # urllib wraps the OSError
            urllib.request.urlopen("http://192.0.2.1/", timeout=0.1)
        assert isinstance(info.value.reason, NetworkBlockedError)
        assert issubclass(NetworkBlockedError, ClefError)
    assert socket.socket.connect is original and network_state() == "on"


def test_the_c_level_socket_is_guarded():
    """``_socket``, under the ``socket`` module's Python wrappers, is what the review got through with."""
    tcp, udp = _socket.socket(), _socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        with airgap():
            with pytest.raises(NetworkBlockedError, match=r"192\.0\.2\.1:9"):
                tcp.connect(TEST_NET)
            with pytest.raises(NetworkBlockedError, match=r"192\.0\.2\.1:9"):
                tcp.connect_ex(TEST_NET)
            with pytest.raises(NetworkBlockedError, match=r"192\.0\.2\.1:9"):
                udp.sendto(b"x", TEST_NET)
    finally:
        tcp.close()
        udp.close()


def test_udp_to_non_loopback_is_refused_before_sending_and_loopback_udp_works():
    with airgap(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        with pytest.raises(NetworkBlockedError, match=r"sending to 192\.0\.2\.1:9"):
            udp.sendto(b"x", TEST_NET)
        with pytest.raises(NetworkBlockedError, match=r"sending to 192\.0\.2\.1:9"):
            udp.sendmsg([b"x"], [], 0, TEST_NET)
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as udp6, \
                pytest.raises(NetworkBlockedError, match=r"2001:db8::1"):
            udp6.sendto(b"x", (TEST_NET6, 9))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as receiver:
            receiver.bind(("127.0.0.1", 0))
            receiver.settimeout(5)
            assert udp.sendto(b"ping", receiver.getsockname()) == 4
            udp.sendmsg([b"pong"], [], 0, receiver.getsockname())
            assert receiver.recv(16) == b"ping" and receiver.recv(16) == b"pong"


def test_raw_and_packet_sockets_are_refused():
    with airgap():
        with pytest.raises(NetworkBlockedError, match="raw socket"):
            socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        if hasattr(socket, "AF_PACKET"):
            with pytest.raises(NetworkBlockedError, match="raw socket"):
                socket.socket(socket.AF_PACKET, socket.SOCK_RAW)


@pytest.mark.parametrize(("call", "target"), [
    (lambda: socket.gethostbyname("localhost"), "localhost"),
    (lambda: socket.gethostbyname_ex("localhost"), "localhost"),
    (lambda: socket.gethostbyaddr("127.0.0.1"), "127.0.0.1"),
    (lambda: socket.getnameinfo(("127.0.0.1", 80), 0), "127.0.0.1"),
    (lambda: socket.getaddrinfo("127.1", 80), "127.1"),  # not a name the guard knows; libc reads it as 127.0.0.1
], ids=["gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getnameinfo", "getaddrinfo"])
def test_name_lookups_are_closed(call, target):
    with airgap(), pytest.raises(NetworkBlockedError, match=target.replace(".", r"\.")):
        call()
    call()  # the guard is off again: the same lookup answers (from the hosts file)


def test_what_a_loopback_client_needs_still_resolves():
    with airgap():
        assert socket.gethostbyname("127.0.0.1") == "127.0.0.1"  # numeric: no lookup happens
        assert {info[4][0] for info in socket.getaddrinfo("localhost", 80)} <= {"127.0.0.1", "::1"}
        assert socket.getaddrinfo("192.0.2.1", 80)[0][4][0] == "192.0.2.1"  # numeric; connecting is what is refused
        assert socket.getfqdn("127.0.0.1") == "127.0.0.1"  # http.server's reverse lookup falls back to the address


def test_asyncio_loopback_works_and_the_rest_is_refused():
    async def scenario() -> bytes:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.read(4))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            reader, writer = await asyncio.open_connection("localhost", port)
            writer.write(b"ping")
            answer = await reader.read(4)
            writer.close()
            with pytest.raises(NetworkBlockedError, match=r"192\.0\.2\.1:9"):
                await asyncio.open_connection(*TEST_NET)
            with pytest.raises(NetworkBlockedError, match=r"127\.1"):
                await asyncio.open_connection("127.1", port)
        return answer

    with airgap():
        assert asyncio.run(scenario()) == b"ping"


def test_child_processes_inherit_the_offline_environment():
    keys = sorted(airgap_module.OFFLINE_ENV)
    code = f"import os; print(' '.join(os.environ.get(k, '-') for k in {keys!r}))"
    with airgap():
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1"] * len(airgap_module.OFFLINE_ENV)
    assert "HF_HUB_DISABLE_TELEMETRY" in airgap_module.OFFLINE_ENV


def test_network_state_names_the_mechanism(monkeypatch):
    assert network_state() == "on"
    with airgap() as state:
        assert state == "off (guard)"
    monkeypatch.setattr(airgap_module, "_namespace", "network namespace")
    with airgap() as state:
        assert state == "off (namespace)" == network_state()
    with airgap(enabled=False) as state:
        assert state == "on"


@pytest.mark.parametrize(("args", "expected"), [
    (["--allow-network"], True), (["--model", "x", "--allow-net"], True), (["--al"], True), (["--a"], True),
    ([], False), (["--model", "x"], False), (["--", "--allow-network"], False), (["-a"], False),
    (["--allow-networks"], False),
])
def test_wants_network(args, expected):
    assert wants_network(args) is expected


def test_environment_restored(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    with airgap():
        with airgap():  # nested: one guard
            assert os.environ["HF_HUB_OFFLINE"] == "1"
        assert network_state() == "off (guard)"
        with pytest.raises(NetworkBlockedError):  # the inner exit left the outer guard on
            socket.gethostbyname("localhost")
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["TRANSFORMERS_OFFLINE"] == "0"
    assert socket.gethostbyname("localhost") == "127.0.0.1"


def test_allow_network_changes_nothing():
    original = socket.getaddrinfo
    with airgap(enabled=False) as state:
        assert state == "on" and socket.getaddrinfo is original


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.1", "::1", "localhost", "0.0.0.0", "::", None, "",
                                  "::ffff:127.0.0.1"])
def test_local_hosts(host):
    assert is_local_host(host)


@pytest.mark.parametrize("host", ["93.184.216.34", "10.0.0.1", "192.168.1.2", "example.com", "2001:db8::1",
                                  "::ffff:192.0.2.1", "127.1"])
def test_non_local_hosts(host):
    assert not is_local_host(host)


def test_loopback_server_and_client_work_inside_the_gap():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's naming
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    with airgap():
        server = http.server.HTTPServer(("127.0.0.1", 0), Handler)  # bind + listen under the guard
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            port = server.server_address[1]
            assert urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read() == b"ok"
            assert urllib.request.urlopen(f"http://localhost:{port}/", timeout=5).read() == b"ok"
        finally:
            server.shutdown()
            server.server_close()


def _data(path: Path) -> Path:
    path.write_text('{"id": "a", "state": "card declined", "questions": {"q": {"type": "noul"}}, '
                    '"labels": {"q": true}}\n', encoding="utf-8")
    return path


def test_eval_refuses_a_public_connection(tiny_llama: Path, tmp_path: Path, monkeypatch, capsys):
    """A model load that phones home during `clef-local eval` fails with the target named."""
    import clef_local
    from clef_local.quality.evaluate import main

    real_load = clef_local.load

    def phoning_load(*args, **kwargs):
        socket.create_connection(("192.0.2.1", 80), timeout=0.5)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(clef_local, "load", phoning_load)
    code = main(["--model", str(tiny_llama), "--data", str(_data(tmp_path / "d.jsonl")), "--no-progress"])
    assert code == 2
    assert "192.0.2.1:80" in capsys.readouterr().err


def test_eval_allows_loopback(tiny_llama: Path, tmp_path: Path, monkeypatch, capsys):
    import clef_local
    from clef_local.quality.evaluate import main

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    real_load = clef_local.load

    def loopback_load(*args, **kwargs):
        with socket.create_connection(listener.getsockname(), timeout=5):
            pass
        return real_load(*args, **kwargs)

    monkeypatch.setattr(clef_local, "load", loopback_load)
    try:
        code = main(["--model", str(tiny_llama), "--data", str(_data(tmp_path / "d.jsonl")), "--no-progress",
                     "--dtype", "float32"])
    finally:
        listener.close()
    assert code == 0
    assert "network: off (guard)" in capsys.readouterr().out
