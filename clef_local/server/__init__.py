"""``clef-local serve``: the SystemOne HTTP API over the public Python API (docs/serving.md).

    app.py        FastAPI routes, body handling, auth, error shapes, OpenAPI
    body.py       Content-Type and Content-Encoding (zstd, gzip), size limits, safe JSON parsing
    guard.py      Host and Origin checks (DNS rebinding, other web pages), shared with the UI
    connections.py  header and body read deadlines, the connection cap (uvicorn's h11 protocol)
    scheduler.py  dynamic batching on one inference thread
    metrics.py    Prometheus text metrics
    config.py     settings, model names and aliases, the bind warning
    run.py        ``serve`` and a threaded server for tests and benchmarks

Importing this package is cheap; FastAPI and uvicorn load only when an app is built or served.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["JEV_ALIASES", "ServerConfig", "ThreadedServer", "create_app", "serve"]

if TYPE_CHECKING:
    from clef_local.server.app import create_app
    from clef_local.server.config import JEV_ALIASES, ServerConfig
    from clef_local.server.run import ThreadedServer, serve

_WHERE = {"create_app": "app", "ServerConfig": "config", "JEV_ALIASES": "config", "serve": "run",
          "ThreadedServer": "run"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"clef_local.server.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'clef_local.server' has no attribute {name!r}")
