"""The network namespace: decide/eval/drift/calibrate, run as their own process, leave the host's network behind
(where the kernel allows it; elsewhere they say `off (guard)`), serve never does, --allow-network keeps the host's.

Every namespace here is entered by a child process; the test process keeps its network. Nothing is sent anywhere:
the one non-loopback target is a UDP ``connect`` (which transmits nothing) to TEST-NET-1, and only after the child
has checked that loopback is its only interface.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from clef_local.airgap import NAMESPACE_COMMANDS, isolate_process, namespace_support

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

INSIDE = """
import errno, json, socket, sys
from clef_local.airgap import enter_network_namespace
kind = enter_network_namespace()
names = [name for _, name in socket.if_nameindex()]
if names != ["lo"]:
    print(json.dumps({"kind": kind, "interfaces": names}))
    sys.exit(1)  # not isolated: stop before touching any other address
listener = socket.create_server(("127.0.0.1", 0))
with socket.create_connection(listener.getsockname(), timeout=5) as client:
    peer, _ = listener.accept()
    client.sendall(b"ping")
    echoed = peer.recv(4)
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    udp.connect(("192.0.2.1", 9))  # a route lookup only: UDP connect sends nothing
    route = "exists"
except OSError as exc:
    route = errno.errorcode[exc.errno]
print(json.dumps({"kind": kind, "interfaces": names, "loopback": echoed.decode(), "route": route}))
"""


@cache
def support() -> dict[str, Any]:
    return namespace_support()


def _data(path: Path) -> Path:
    path.write_text('{"id": "a", "state": "card declined", "questions": {"q": {"type": "noul"}}, '
                    '"labels": {"q": true}}\n', encoding="utf-8")
    return path


def test_the_probe_answers_for_this_machine():
    info = support()
    assert isinstance(info["available"], bool)
    if info["available"]:
        assert info["interfaces"] == ["lo"] and info["kind"].endswith("namespace")
    else:
        assert info["why_not"], "a refusal must say why"


def test_a_namespace_has_only_loopback_and_no_route_off_the_machine():
    if not support()["available"]:
        pytest.skip(f"no network namespace on this machine: {support()['why_not']}")
    before = socket.if_nameindex()
    done = subprocess.run([sys.executable, "-c", INSIDE], capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    inside = json.loads(done.stdout)
    assert inside["interfaces"] == ["lo"] and inside["loopback"] == "ping"
    assert inside["route"] == "ENETUNREACH"
    assert socket.if_nameindex() == before  # the test process kept its own network


def test_an_ordinary_user_gets_a_user_namespace_with_the_same_ids():
    """Without CAP_SYS_ADMIN a network namespace needs a user namespace; the uid and gid stay the same inside."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the child as an ordinary user")
    if not support()["available"]:
        pytest.skip(f"no network namespace on this machine: {support()['why_not']}")
    code = ("import json, os, socket\nfrom clef_local.airgap import enter_network_namespace\n"
            "kind = enter_network_namespace()\n"
            "print(json.dumps([kind, [n for _, n in socket.if_nameindex()], os.getuid(), os.getgid()]))\n")
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60, env=ENV, cwd="/")
    if done.returncode != 0 and "unshare" in done.stderr and "refused" in done.stderr:
        pytest.skip(f"this kernel gives ordinary users no user namespace: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == ["user + network namespace", ["lo"], 65534, 65534]


def test_a_threaded_process_is_not_moved():
    """A namespace entered by one thread of many would not hold the others: refused before any system call."""
    code = ("import threading, time, json\n"
            "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
            "from clef_local.airgap import enter_network_namespace\n"
            "try:\n    enter_network_namespace()\nexcept OSError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV)
    assert "already runs 2 threads" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("allow", [False, True], ids=["default", "allow-network"])
def test_eval_as_its_own_process_says_how_it_is_offline(tiny_llama: Path, tmp_path: Path, allow: bool):
    command = [sys.executable, "-m", "clef_local.cli", "eval", "--model", str(tiny_llama), "--data",
               str(_data(tmp_path / "d.jsonl")), "--no-progress", "--dtype", "float32", "--json",
               str(tmp_path / "m.json")]
    done = subprocess.run(command + (["--allow-network"] if allow else []), capture_output=True, text=True,
                          timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = "on" if allow else "off (namespace)" if support()["available"] else "off (guard)"
    assert f"network: {expected}\n" in done.stdout
    assert json.loads((tmp_path / "m.json").read_text())["meta"]["network"] == expected
    if not allow and not support()["available"]:
        assert "no network namespace for this run" in done.stderr


def test_commands_that_keep_the_hosts_network():
    """serve's clients are outside any namespace; --allow-network keeps the network. Neither tries (no unshare)."""
    assert "serve" not in NAMESPACE_COMMANDS and {"decide", "eval", "drift", "probe", "calibrate"} == NAMESPACE_COMMANDS
    before = socket.if_nameindex()
    assert isolate_process("serve", ["--port", "8077"]) is None
    assert isolate_process("eval", ["--model", "x", "--allow-network"]) is None
    assert isolate_process("inspect", []) is None
    assert socket.if_nameindex() == before


def test_doctor_reports_the_isolation_here():
    from clef_local.planning.doctor import network_isolation, render, report

    info = report(probe=False)
    net = info["network"]
    assert net == network_isolation() and net["namespace"] == support()["available"]
    mode = "off (namespace)" if net["namespace"] else "off (guard)"
    assert net["commands"] == {"calibrate": mode, "decide": mode, "drift": mode, "eval": mode, "probe": mode,
                               "serve": "off (guard)"}
    text = render(info)
    assert "serve: off (guard): its clients are outside any namespace" in text
    if not net["namespace"]:
        assert net["why_not"] in text
