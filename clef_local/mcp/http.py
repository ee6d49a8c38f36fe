"""``clef-local mcp --http``: the SDK's streamable HTTP app at ``/mcp`` behind ``serve``'s guards.

From the outside in: :class:`~clef_local.server.guard.HostGuard` (a foreign ``Host`` is 400, a web page's foreign
``Origin`` 403, before anything runs; the SDK's own DNS-rebinding check is off so that one policy, serve's, applies),
CORS for ``--cors-origin`` pages, :class:`ApiKeyGuard` (``--api-key``: 401 without ``Authorization: Bearer KEY``),
then the SDK app with serve's 13 MiB body limit and a cap on open sessions. uvicorn runs it with serve's read
deadlines and connection cap (:func:`~clef_local.server.run.uvicorn_options`). docs/mcp.md#http.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from mcp.server.transport_security import TransportSecuritySettings

from clef_local.mcp.server import ClefTools, build_server
from clef_local.server.config import ServerConfig
from clef_local.server.guard import HostGuard

MCP_PATH = "/mcp"
# Sessions open at once (an agent holds one); beyond it the SDK answers 503 until one ends or idles out.
MAX_SESSIONS = 64
SESSION_IDLE_S = 30 * 60.0
# what a browser client sends and reads besides the simple headers (the streamable HTTP transport's own)
CORS_HEADERS = ["authorization", "content-type", "mcp-session-id", "mcp-protocol-version", "last-event-id"]


class ApiKeyGuard:
    """ASGI middleware: ``Authorization: Bearer KEY`` on every HTTP request, else 401 ``authentication_error``
    (the body and header ``serve`` sends). CORS preflights pass: they carry no credentials by design."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.key = key.encode()

    def refusal(self, headers: dict[bytes, bytes]) -> str | None:
        """Why the request is refused, or None."""
        header = headers.get(b"authorization")
        if header is None:
            return "missing API key: send 'Authorization: Bearer <key>'"
        scheme, _, token = header.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), self.key):
            return "invalid API key"
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = {name.lower(): value for name, value in reversed(scope.get("headers", ()))}  # the first wins
        message = self.refusal(headers)
        if message is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps({"detail": {"error_type": "authentication_error", "message": message}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def create_http_app(tools: ClefTools, config: ServerConfig | None = None) -> Any:
    """The ASGI app serving ``tools`` over streamable HTTP at :data:`MCP_PATH` (its lifespan runs the tools)."""
    config = config or tools.config
    server = build_server(tools)
    app: Any = server.streamable_http_app(
        streamable_http_path=MCP_PATH, host=config.host, max_request_body_size=config.max_body_bytes,
        max_sessions=MAX_SESSIONS, session_idle_timeout=SESSION_IDLE_S,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
    if config.api_key:
        app = ApiKeyGuard(app, config.api_key)
    if config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app = CORSMiddleware(app, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST", "DELETE"],
                             allow_headers=CORS_HEADERS, expose_headers=["mcp-session-id"], max_age=600)
    return HostGuard(app, hosts=config.host_names, origins=config.cors_origins)
