"""Who may talk to a local server: the ``Host`` and ``Origin`` checks of ``serve`` and ``ui`` (no framework here).

Every web page the user opens can post to 127.0.0.1, and with DNS rebinding read the answers; so ``Host`` must name
this server (else 400) and a browser's ``Origin`` must be its own or a ``--cors-origin`` (else 403), before anything
runs. :class:`HostGuard` is plain ASGI, so the Gradio app uses it too. docs/serving.md ("Who may call").
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

LOCAL_NAMES = ("localhost", "127.0.0.1", "[::1]")
DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_host(name: str) -> str:
    """A host name as :func:`host_of` returns it: lowercase, an IPv6 address in brackets, no port."""
    name = name.strip().lower()
    bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        return name
    return f"[{address.compressed}]" if address.version == 6 else address.compressed


def split_authority(authority: str) -> tuple[str, int | None] | None:
    """``(host, port)`` of ``host[:port]`` / ``[v6][:port]`` (host normalized); ``None`` when malformed."""
    authority = authority.strip()
    if not authority or any(c in authority for c in " /\\@?#\t"):
        return None
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            return None
        host, rest = authority[: end + 1], authority[end + 1:]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text = authority.rpartition(":") if ":" in authority else (authority, "", None)
        if sep and ":" in host:  # an IPv6 address without brackets is not a valid Host
            return None
    if port_text is not None and not (port_text.isdigit() and len(port_text) <= 5):
        return None
    host = normalize_host(host)
    return (host, int(port_text) if port_text is not None else None) if host else None


def allowed_host_names(bind_host: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The ``Host`` names a server bound to ``bind_host`` answers: the loopback names, the bind address itself and
    ``extra`` (``--allowed-host``)."""
    return frozenset({*LOCAL_NAMES, normalize_host(bind_host), *(normalize_host(name) for name in extra)})


def check_origin_value(origin: str) -> str:
    """A ``--cors-origin`` value, normalized (``scheme://host[:port]``); ``ValueError`` naming the fix otherwise."""
    parts = urlsplit(origin.strip())
    if parts.scheme not in DEFAULT_PORTS or not parts.netloc or parts.path not in ("", "/") or parts.query \
            or parts.fragment or split_authority(parts.netloc) is None:
        raise ValueError(f"--cors-origin {origin[:100]!r}: expected an origin such as http://localhost:3000 "
                         "(scheme, host and port; no path, no wildcard)")
    host, port = split_authority(parts.netloc)  # type: ignore[misc]  # checked just above
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


class HostGuard:
    """ASGI middleware: 400 ``invalid_host`` for a foreign ``Host``, 403 ``forbidden_origin`` for a foreign
    ``Origin`` (see the module docstring); HTTP and WebSocket scopes alike."""

    def __init__(self, app: Any, hosts: Iterable[str], origins: Iterable[str] = ()) -> None:
        self.app = app
        self.hosts = frozenset(normalize_host(h) for h in hosts)
        self.origins = frozenset(check_origin_value(o) for o in origins)

    def refusal(self, headers: dict[bytes, bytes], hosts: int = 1) -> tuple[int, str, str] | None:
        """``(status, error_type, message)`` when the request must be refused, else ``None`` (``hosts``: how many
        ``Host`` headers the request has; more than one is refused, as HTTP/1.1 requires)."""
        if hosts > 1:
            return 400, "invalid_host", "the request has several Host headers; send one"
        raw_host = headers.get(b"host", b"").decode("latin-1")
        parsed = split_authority(raw_host)
        if parsed is None or parsed[0] not in self.hosts:
            shown = repr(raw_host[:100]) if raw_host else "missing"
            return 400, "invalid_host", (
                f"the Host header is {shown}; this server answers only to {', '.join(sorted(self.hosts))}. "
                "Pass --allowed-host NAME to accept another name.")
        raw_origin = headers.get(b"origin")
        if raw_origin is None:
            return None
        origin = raw_origin.decode("latin-1").strip()
        parts = urlsplit(origin)
        authority = split_authority(parts.netloc) if parts.scheme in DEFAULT_PORTS else None
        if authority is not None:
            origin_port = authority[1] or DEFAULT_PORTS[parts.scheme]
            if (authority[0], origin_port) == (parsed[0], parsed[1] or DEFAULT_PORTS["http"]):
                return None  # the server's own pages (/docs, the UI)
            if f"{parts.scheme}://{authority[0]}" + (f":{authority[1]}" if authority[1] else "") in self.origins:
                return None
        return 403, "forbidden_origin", (
            f"requests from the web page at {origin[:100]!r} are refused: this server only answers its own pages "
            "and clients that are not browsers. Pass --cors-origin ORIGIN to allow a page's origin.")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = {}
        hosts = 0
        for name, value in scope.get("headers", ()):
            name = name.lower()
            hosts += name == b"host"
            headers.setdefault(name, value)  # the first of repeated headers, as servers read them
        refused = self.refusal(headers, hosts)
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, error_type, message = refused
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": error_type})
            return
        body = json.dumps({"detail": {"error_type": error_type, "message": message}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
