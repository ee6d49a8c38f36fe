"""Air-gapped runs: no hub access and no traffic to anything but this machine (docs/quality.md#the-air-gap).

Two layers: the guard (``with airgap():``: the offline environment variables and an audit hook on Python's socket
events) in every run, and, where Linux allows it, :func:`isolate_process`: a fresh network namespace with loopback
only for ``decide``, ``eval``, ``drift`` and ``calibrate``. ``--allow-network`` turns both off.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

from clef_local.errors import NetworkBlockedError

log = logging.getLogger(__name__)

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1"}
NAMESPACE_COMMANDS = frozenset({"decide", "eval", "drift", "probe", "calibrate"})
ALLOW_FLAG = "--allow-network"
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback", ""}
_INET = frozenset({socket.AF_INET, socket.AF_INET6})
# families whose peers are on this machine by construction: Unix sockets, and netlink (the kernel itself)
_LOCAL_FAMILIES = frozenset(f for f in (getattr(socket, "AF_UNIX", None), getattr(socket, "AF_NETLINK", None))
                            if f is not None)
_PACKET = getattr(socket, "AF_PACKET", None)
_lock = threading.Lock()
_depth = 0
_active = False  # read by the audit hook on every audited event of the process: keep it a plain global
_hook_installed = False
_namespace: str | None = None  # what isolate_process entered ("network namespace", ...), None if nothing
_namespace_refusal: str | None = None  # why isolate_process could not enter one


def is_local_host(host: Any) -> bool:
    """True for loopback or unspecified addresses and the names of this machine's loopback."""
    if host is None:
        return True
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    host = str(host).strip("[]").split("%", 1)[0].lower()
    if host in _LOCAL_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name other than localhost: resolving it would already leave the machine
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is loopback, ::ffff:192.0.2.1 is not
    return address.is_loopback or address.is_unspecified


def _is_numeric(host: Any) -> bool:
    try:
        ipaddress.ip_address(str(host.decode() if isinstance(host, bytes) else host).strip("[]").split("%", 1)[0])
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def _refuse(what: str) -> NoReturn:
    raise NetworkBlockedError(f"network access is off: refused {what} (clef-local runs air-gapped; pass "
                              f"{ALLOW_FLAG} to permit it)")


def _target(address: Any) -> tuple[Any, Any]:
    if isinstance(address, tuple) and address:
        return address[0], address[1] if len(address) > 1 else None
    return address, None


def _check_peer(sock: Any, address: Any, what: str) -> None:
    family = getattr(sock, "family", None)
    if family in _LOCAL_FAMILIES:
        return
    if family in _INET:
        host, port = _target(address)
        if not is_local_host(host):
            _refuse(f"{what} {host}:{port}")
        return
    _refuse(f"{what} {address!r} (address family {family}: only loopback, Unix and netlink sockets are allowed)")


def _on_connect(args: tuple[Any, ...]) -> None:
    _check_peer(args[0], args[1], "a connection to")


def _on_send(args: tuple[Any, ...]) -> None:
    if args[1] is not None:  # sendmsg without an address: a connected socket, checked when it connected
        _check_peer(args[0], args[1], "sending to")


def _on_new(args: tuple[Any, ...]) -> None:
    family, kind = args[1], args[2]
    if family == _PACKET or (family in _INET and kind != -1 and kind & 0xF == socket.SOCK_RAW):
        _refuse(f"a raw socket (family {family}, type {kind}): it can send to any address")


def _on_getaddrinfo(args: tuple[Any, ...]) -> None:
    # numeric addresses resolve without leaving the machine (a server binding its LAN address needs that);
    # connecting to them is what the connect check refuses
    host, port = args[0], args[1]
    if not is_local_host(host) and not _is_numeric(host):
        _refuse(f"to resolve {host}:{port}")


def _on_gethostbyname(args: tuple[Any, ...]) -> None:
    if not _is_numeric(args[0]):
        _refuse(f"to resolve {args[0]} with gethostbyname (only getaddrinfo resolves, loopback names only)")


def _on_reverse(args: tuple[Any, ...]) -> None:
    _refuse(f"a reverse lookup of {args[0]!r}")


_HANDLERS: dict[str, Callable[[tuple[Any, ...]], None]] = {
    "socket.connect": _on_connect, "socket.sendto": _on_send, "socket.sendmsg": _on_send,
    "socket.__new__": _on_new, "socket.getaddrinfo": _on_getaddrinfo, "socket.gethostbyname": _on_gethostbyname,
    "socket.gethostbyaddr": _on_reverse, "socket.getnameinfo": _on_reverse,
}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _active:  # the hook lives as long as the process; off, it costs this test and nothing more
        return
    handler = _HANDLERS.get(event)
    if handler is not None:
        handler(args)


def _install_hook() -> None:
    global _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit)
        _hook_installed = True


def _set_hub_constants(value: bool | None) -> bool | None:
    # huggingface_hub reads HF_HUB_OFFLINE once at import; a module already imported needs its constant set
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is None or not hasattr(constants, "HF_HUB_OFFLINE"):
        return None
    previous = bool(getattr(constants, "HF_HUB_OFFLINE"))  # noqa: B009 (a module attribute mypy cannot see)
    if value is not None:
        setattr(constants, "HF_HUB_OFFLINE", value)  # noqa: B010
    return previous


def network_state() -> str:
    """``"off (namespace)"`` inside an active :func:`airgap` in a process that :func:`isolate_process` moved into
    its own network namespace, ``"off (guard)"`` inside an active :func:`airgap` otherwise, else ``"on"``."""
    if _depth == 0:
        return "on"
    return "off (namespace)" if _namespace else "off (guard)"


@contextmanager
def airgap(enabled: bool = True) -> Iterator[str]:
    """Run the body with the network off (``enabled``); yields :func:`network_state` (``"off (guard)"``,
    ``"off (namespace)"`` or ``"on"``), the value reports print as ``network:``.

    Nested uses share one guard; the environment and the hub constant are restored on exit, and the hook goes
    back to doing nothing.
    """
    global _depth, _active
    if not enabled:
        log.info("network: on (%s)", ALLOW_FLAG)
        yield network_state()
        return
    with _lock:
        _depth += 1
        first = _depth == 1
        if first:
            env_before = {k: os.environ.get(k) for k in OFFLINE_ENV}
            os.environ.update(OFFLINE_ENV)
            hub_before = _set_hub_constants(True)
            _install_hook()
            _active = True
            log.info("network: %s (loopback only; pass %s to permit other addresses)", network_state(), ALLOW_FLAG)
    try:
        yield network_state()
    finally:
        with _lock:
            _depth -= 1
            if first:
                _active = False
                _set_hub_constants(hub_before)
                for key, value in env_before.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value


# ---------------------------------------------------------------------------------------------- the namespace
def wants_network(args: Sequence[str]) -> bool:
    """Whether a command line asks for ``--allow-network``. argparse also accepts any unambiguous prefix down to
    ``--a``, so every such prefix counts (an ambiguous one makes argparse fail the command anyway)."""
    for arg in args:
        if arg == "--":
            return False
        if len(arg) > 2 and arg.startswith("--") and ALLOW_FLAG.startswith(arg):
            return True
    return False


def _loopback_up() -> None:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh22x", b"lo", 0)  # struct ifreq: name, flags, the rest of the union
        flags = struct.unpack("16sh", fcntl.ioctl(sock, _SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | _IFF_UP))


def _map_ids(uid: int, gid: int) -> None:
    # the same ids inside as outside: files keep their owner, tools see the same user (unshare -r maps to root)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w", encoding="ascii") as file:
            file.write(text)


def enter_network_namespace() -> str:
    """Move this process into a new network namespace whose only interface is loopback (brought up); returns what
    it entered (``"network namespace"`` or ``"user + network namespace"``).

    Linux only, and only while the process runs a single thread (a user namespace requires it, and a namespace
    entered by one thread of many would not hold the others). Raises :class:`OSError` saying why when the kernel
    refuses; nothing has changed then. There is no way back: call it at the start of a process of its own.
    """
    if not sys.platform.startswith("linux"):
        raise OSError(errno.ENOSYS, f"network namespaces are a Linux feature (this is {sys.platform})")
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise OSError(errno.EINVAL, f"the process already runs {threads} threads; a namespace must be entered "
                                    "before any thread starts")
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.geteuid(), os.getegid()
    kind = "network namespace"
    if libc.unshare(CLONE_NEWNET) != 0:  # needs CAP_SYS_ADMIN; an ordinary user takes a user namespace with it
        code = ctypes.get_errno()
        if code != errno.EPERM:
            raise OSError(code, f"unshare(CLONE_NEWNET) was refused: {os.strerror(code)}")
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"unshare(CLONE_NEWUSER | CLONE_NEWNET) was refused: {os.strerror(code)}")
        kind = "user + network namespace"
        try:
            _map_ids(uid, gid)
        except OSError as exc:  # isolated all the same; only the ids look different inside
            log.warning("in a new user namespace but could not map uid %d / gid %d into it (%s): the process sees "
                        "itself as the overflow user", uid, gid, exc)
    try:
        _loopback_up()
    except OSError as exc:  # still no route off the machine; only loopback connections fail
        log.warning("in a new %s but could not bring its loopback interface up (%s): loopback connections "
                    "will fail in this run", kind, exc)
        kind += " (loopback down)"
    return kind


def isolate_process(command: str | None, args: Sequence[str]) -> str | None:
    """For ``clef-local COMMAND ARGS`` run as its own process: enter a fresh network namespace when the command is
    one of :data:`NAMESPACE_COMMANDS` and ``--allow-network`` is absent. Returns what was entered, or None (not such
    a command, or the kernel refused: then the reason is logged, the guard alone keeps the run offline and
    :func:`network_state` says ``off (guard)``). Never call it in a process that must keep its network: tests,
    servers, notebooks."""
    global _namespace, _namespace_refusal
    if command not in NAMESPACE_COMMANDS or wants_network(args) or _namespace:
        return _namespace
    try:
        _namespace = enter_network_namespace()
    except OSError as exc:
        _namespace_refusal = str(exc)
        log.info("no network namespace for this run (%s): the in-process guard keeps it offline", exc)
        return None
    log.info("network: this process runs in its own %s, loopback only", _namespace)
    return _namespace


_PROBE = """
import json, socket, sys
from clef_local.airgap import enter_network_namespace
try:
    kind = enter_network_namespace()
except OSError as exc:
    print(json.dumps({"available": False, "why_not": str(exc)}))
    sys.exit(0)
names = [name for _, name in socket.if_nameindex()]
print(json.dumps({"available": names == ["lo"], "kind": kind, "interfaces": names,
                  "why_not": None if names == ["lo"] else f"interfaces left inside: {names}"}))
"""


def namespace_support(timeout: float = 20.0) -> dict[str, Any]:
    """Whether this machine lets a clef-local process enter its own network namespace: tried for real in a child
    process (the parent is not touched). ``{"available": bool, "kind": ..., "interfaces": [...], "why_not": str}``."""
    if not sys.platform.startswith("linux"):
        return {"available": False, "why_not": f"network namespaces are a Linux feature (this is {sys.platform})"}
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"available": False, "why_not": f"the probe did not run: {exc}"}
    try:
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"available": False, "why_not": f"the probe failed (exit {done.returncode}): "
                                               f"{done.stderr.strip()[-300:]}"}
