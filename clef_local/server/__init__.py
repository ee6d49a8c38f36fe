"""``clef-local serve``: the SystemOne HTTP API over the public Python API (docs/serving.md; the modules:
docs/architecture.md#package-map). Importing this package is cheap: FastAPI and uvicorn load only when an app is
built or served.
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
