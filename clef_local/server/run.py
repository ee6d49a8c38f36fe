"""Starting the server: ``serve`` (what ``clef-local serve`` calls) and :class:`ThreadedServer` (tests, benchmarks)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from clef_local.server.config import DEFAULT_NAME, ServerConfig, bind_warning, parse_model_specs

log = logging.getLogger(__name__)


def load_models(specs: Mapping[str, Path], *, dtype: str | None = None, device: str | None = None,
                confidence: str = "jev") -> dict[str, Any]:
    """Load each ``{name: release directory}`` with the public API (``clef_local.load``)."""
    import clef_local

    kwargs: dict[str, Any] = {"dtype": dtype, "confidence": confidence}
    if device:
        kwargs["device"] = device
    models = {}
    for name, path in specs.items():
        log.info("loading %s from %s", name, path)
        models[name] = clef_local.load(path, **kwargs)
    return models


def serve(model_specs: Sequence[str] = (), *, host: str = "127.0.0.1", port: int = 8077, api_key: str | None = None,
          max_batch: int = 8, max_wait_ms: float = 5.0, max_queue: int = 64, confidence: str = "jev",
          dtype: str | None = None, device: str | None = None, log_level: str = "info") -> int:
    """Load the models and serve them until interrupted (SIGINT/SIGTERM finish in-flight requests first).

    ``model_specs`` are ``NAME=DIR`` strings; none means the default model, served as ``clef-local``.
    """
    import uvicorn

    config = ServerConfig(host=host, port=port, api_key=api_key, max_batch=max_batch, max_wait_ms=max_wait_ms,
                          max_queue=max_queue, confidence=confidence)  # type: ignore[arg-type]
    if model_specs:
        specs = parse_model_specs(model_specs)
    else:
        from clef_local.demo.default import default_model_path

        specs = {DEFAULT_NAME: default_model_path()}
    if warning := bind_warning(host, api_key):
        print(warning, file=sys.stderr)
    models = load_models(specs, dtype=None if dtype in (None, "auto") else dtype, device=device,
                         confidence=confidence)
    from clef_local.server.app import create_app

    app = create_app(models, config)
    uvicorn.run(app, host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=int(config.graceful_timeout_s), server_header=False)
    return 0


class ThreadedServer:
    """A uvicorn server on a background thread, for tests and benchmarks (loopback, free port by default).

    >>> with ThreadedServer(app) as server:
    ...     httpx.get(server.url + "/health")
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, graceful_timeout_s: int = 30) -> None:
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                     timeout_graceful_shutdown=graceful_timeout_s, server_header=False)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="clef-uvicorn", daemon=True)
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ThreadedServer:
        """Start and wait until the server accepts connections."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful stop: in-flight requests finish, then the lifespan shutdown runs."""
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
