"""Air-gapped runs: no hub access and no connection to anything but this machine (README.md, issue 6).

``with airgap():`` sets ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1`` and ``HF_DATASETS_OFFLINE=1`` and patches
``socket.socket.connect``/``connect_ex``, ``socket.create_connection`` and ``socket.getaddrinfo`` (name lookups
other than ``localhost``) so that any attempt to reach a non-loopback address raises
:class:`~clef_local.errors.NetworkBlockedError` naming the target, *before* a packet leaves. Loopback
(127.0.0.0/8, ::1, ``localhost``), Unix sockets and the unspecified address (0.0.0.0, ::, used to bind a server)
stay allowed, so ``clef-local serve`` keeps listening and loopback
clients keep working. ``airgap(enabled=False)`` changes nothing and reports ``network: on``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from clef_local.errors import NetworkBlockedError

log = logging.getLogger(__name__)

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback", ""}
_lock = threading.Lock()
_depth = 0
_saved: dict[str, Any] = {}


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
    return address.is_loopback or address.is_unspecified


def _is_numeric(host: Any) -> bool:
    try:
        ipaddress.ip_address(str(host.decode() if isinstance(host, bytes) else host).strip("[]").split("%", 1)[0])
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def _target(address: Any) -> tuple[Any, Any]:
    if isinstance(address, tuple) and address:
        return address[0], address[1] if len(address) > 1 else None
    return address, None


def _check(family: int, address: Any) -> None:
    if family == getattr(socket, "AF_UNIX", None) or isinstance(address, str | bytes):
        return
    host, port = _target(address)
    if not is_local_host(host):
        raise NetworkBlockedError(f"network access is off: refused a connection to {host}:{port} (clef-local runs "
                                  "air-gapped; pass --allow-network to permit it)")


def _install() -> None:
    original_connect = socket.socket.connect
    original_connect_ex = socket.socket.connect_ex
    original_create = socket.create_connection
    original_getaddrinfo = socket.getaddrinfo
    _saved.update(connect=original_connect, connect_ex=original_connect_ex, create_connection=original_create,
                  getaddrinfo=original_getaddrinfo)

    def connect(self: socket.socket, address: Any) -> None:
        _check(self.family, address)
        return original_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        _check(self.family, address)
        return original_connect_ex(self, address)

    def create_connection(address: Any, *args: Any, **kwargs: Any) -> socket.socket:
        _check(socket.AF_INET, address)
        return original_create(address, *args, **kwargs)

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        # numeric addresses resolve without leaving the machine (a server binding its LAN address needs that);
        # connecting to them is what connect/create_connection refuse
        if not is_local_host(host) and not _is_numeric(host):
            raise NetworkBlockedError(f"network access is off: refused to resolve {host}:{port} (clef-local runs "
                                      "air-gapped; pass --allow-network to permit it)")
        return original_getaddrinfo(host, port, *args, **kwargs)

    socket.socket.connect = connect  # type: ignore[method-assign,assignment]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign,assignment]
    socket.create_connection = create_connection
    socket.getaddrinfo = getaddrinfo


def _uninstall() -> None:
    socket.socket.connect = _saved.pop("connect")  # type: ignore[method-assign]
    socket.socket.connect_ex = _saved.pop("connect_ex")  # type: ignore[method-assign]
    socket.create_connection = _saved.pop("create_connection")
    socket.getaddrinfo = _saved.pop("getaddrinfo")


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
    """``"off"`` inside an active :func:`airgap`, else ``"on"``."""
    return "off" if _depth > 0 else "on"


@contextmanager
def airgap(enabled: bool = True) -> Iterator[str]:
    """Run the body with the network off (``enabled``); yields the state string ``"off"`` or ``"on"``.

    Nested uses share one guard; the environment, the socket functions and the hub constant are restored on exit.
    """
    global _depth
    if not enabled:
        log.info("network: on (--allow-network)")
        yield network_state()
        return
    with _lock:
        _depth += 1
        first = _depth == 1
        if first:
            env_before = {k: os.environ.get(k) for k in OFFLINE_ENV}
            os.environ.update(OFFLINE_ENV)
            hub_before = _set_hub_constants(True)
            _install()
            log.info("network: off (loopback only; pass --allow-network to permit other addresses)")
    try:
        yield "off"
    finally:
        with _lock:
            _depth -= 1
            if first:
                _uninstall()
                _set_hub_constants(hub_before)
                for key, value in env_before.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
