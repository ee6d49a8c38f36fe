"""The air gap: hub access off, connections to non-loopback addresses refused (naming them), loopback allowed."""

from __future__ import annotations

import http.server
import os
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from clef_local.airgap import airgap, is_local_host, network_state
from clef_local.errors import ClefError, NetworkBlockedError

PUBLIC = ("93.184.216.34", 80)


def test_public_connections_are_refused_before_connecting():
    original = socket.socket.connect
    with airgap() as state:
        assert state == "off" and network_state() == "off"
        assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"
        with pytest.raises(NetworkBlockedError, match=r"93\.184\.216\.34:80"):
            socket.create_connection(PUBLIC, timeout=0.1)
        with socket.socket() as s, pytest.raises(NetworkBlockedError, match=r"93\.184\.216\.34:443"):
            s.connect(("93.184.216.34", 443))
        with socket.socket() as s, pytest.raises(NetworkBlockedError, match=r"2606:2800"):
            s.connect_ex(("2606:2800:220:1:248:1893:25c8:1946", 80))
        with pytest.raises(NetworkBlockedError, match=r"huggingface\.co"):
            socket.getaddrinfo("huggingface.co", 443)
        with pytest.raises(urllib.error.URLError) as info:  # urllib wraps the OSError
            urllib.request.urlopen("http://93.184.216.34/", timeout=0.1)
        assert isinstance(info.value.reason, NetworkBlockedError)
        assert issubclass(NetworkBlockedError, ClefError)
    assert socket.socket.connect is original and network_state() == "on"


def test_environment_restored(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    with airgap():
        with airgap():  # nested: one guard
            assert os.environ["HF_HUB_OFFLINE"] == "1"
        assert network_state() == "off"
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["TRANSFORMERS_OFFLINE"] == "0"


def test_allow_network_changes_nothing():
    original = socket.getaddrinfo
    with airgap(enabled=False) as state:
        assert state == "on" and socket.getaddrinfo is original


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.1", "::1", "localhost", "0.0.0.0", "::", None, ""])
def test_local_hosts(host):
    assert is_local_host(host)


@pytest.mark.parametrize("host", ["93.184.216.34", "10.0.0.1", "192.168.1.2", "example.com", "2001:db8::1"])
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
        socket.create_connection(PUBLIC, timeout=0.5)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(clef_local, "load", phoning_load)
    code = main(["--model", str(tiny_llama), "--data", str(_data(tmp_path / "d.jsonl")), "--no-progress"])
    assert code == 2
    assert "93.184.216.34:80" in capsys.readouterr().err


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
    assert "network: off" in capsys.readouterr().out
