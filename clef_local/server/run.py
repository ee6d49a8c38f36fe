"""Starting the server: ``serve`` (what ``clef-local serve`` calls) and :class:`ThreadedServer` (tests, benchmarks)."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from clef_local.errors import ApiUsageError
from clef_local.server.config import (
    BODY_TIMEOUT_S,
    DEFAULT_NAME,
    HEADER_TIMEOUT_S,
    MAX_CONNECTIONS,
    ServerConfig,
    bind_warning,
    parse_model_specs,
)

log = logging.getLogger(__name__)
# What the serve extra installs (pyproject.toml), by import name.
SERVE_MODULES = ("fastapi", "uvicorn", *(("backports.zstd",) if sys.version_info < (3, 14) else ()))


def require_serve_extra() -> None:
    """Fail at once, before any model loads, when the ``serve`` extra is not installed (one line, exit status 2)."""
    missing = [name for name in SERVE_MODULES if _missing(name)]
    if missing:
        raise ApiUsageError(f"clef-local serve needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'}"
                            " not installed: pip install 'clef-local[serve]'")


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:  # the parent package of a dotted name (backports) is missing
        return True


def uvicorn_options(config: ServerConfig) -> dict[str, Any]:
    """The uvicorn settings every clef-local server runs with (``serve`` and :class:`ThreadedServer`).

    The h11 protocol with read deadlines and a connection cap (:mod:`clef_local.server.connections`), no
    WebSocket support (no route needs it), no ``server`` header, and the graceful shutdown timeout.
    """
    from clef_local.server.connections import guarded_protocol

    return {"http": guarded_protocol(config.header_timeout_s, config.body_timeout_s, config.max_connections),
            "ws": "none", "server_header": False, "timeout_graceful_shutdown": int(config.graceful_timeout_s)}


def load_models(specs: Mapping[str, Path], *, dtype: str | None = None, device: str | None = None,
                confidence: str = "jev", media_limits: Any = None, state_cache: int | None = None,
                max_length: int | None = None, offload: str = "none") -> dict[str, Any]:
    """Load each ``{name: release directory}`` with the public API (``clef_local.load``); ``state_cache``: bytes
    of state cache per model (None: sized by the planner); ``max_length``: each model's longest request (None: its
    default); ``offload``: ``clef_local.load``'s (``disk``: streamed from disk, slow)."""
    import clef_local

    kwargs: dict[str, Any] = {"dtype": dtype, "confidence": confidence, "state_cache": state_cache,
                              "max_length": max_length, "offload": offload}
    if media_limits is not None:
        kwargs["media_limits"] = media_limits
    if device:
        kwargs["device"] = device
    models = {}
    for name, path in specs.items():
        log.info("loading %s from %s", name, path)
        models[name] = clef_local.load(path, **kwargs)
    return models


def serve(model_specs: Sequence[str] = (), *, host: str = "127.0.0.1", port: int = 8077, api_key: str | None = None,
          max_batch: int = 8, max_wait_ms: float = 5.0, max_queue: int = 64, confidence: str = "jev",
          dtype: str | None = None, device: str | None = None, log_level: str = "info",
          allowed_hosts: Sequence[str] = (), cors_origins: Sequence[str] = (),
          header_timeout: float = HEADER_TIMEOUT_S, body_timeout: float = BODY_TIMEOUT_S,
          max_connections: int = MAX_CONNECTIONS, threads: int | None = None, media_limits: Any = None,
          state_cache: int | None = None, max_length: int | None = None, offload: str = "none") -> int:
    """Load the models and serve them until interrupted (SIGINT/SIGTERM finish in-flight requests first).

    ``model_specs`` are ``NAME=DIR`` strings; none means the default model, served as ``clef-local``.
    ``media_limits`` (:class:`~clef_local.runtime.media.MediaLimits`) bound each request's images and videos;
    ``max_length``: the longest request in tokens (``clef_local.load(max_length=…)``).
    """
    require_serve_extra()
    import uvicorn

    config = ServerConfig(host=host, port=port, api_key=api_key, max_batch=max_batch, max_wait_ms=max_wait_ms,
                          max_queue=max_queue, confidence=confidence,  # type: ignore[arg-type]
                          allowed_hosts=tuple(allowed_hosts), cors_origins=tuple(cors_origins),
                          header_timeout_s=header_timeout, body_timeout_s=body_timeout,
                          max_connections=max_connections, threads=threads, state_cache=state_cache)
    if model_specs:
        specs = parse_model_specs(model_specs)
    else:
        from clef_local.demo.default import default_model_path

        specs = {DEFAULT_NAME: default_model_path()}
    if warning := bind_warning(host, api_key):
        print(warning, file=sys.stderr)
    models = load_models(specs, dtype=None if dtype in (None, "auto") else dtype, device=device,
                         confidence=confidence, media_limits=media_limits, state_cache=config.state_cache,
                         max_length=max_length, offload=offload)
    from clef_local.server.app import create_app

    app = create_app(models, config)
    uvicorn.run(app, host=host, port=port, log_level=log_level, **uvicorn_options(config))
    return 0


def add_server_flags(parser: argparse.ArgumentParser, *, port: int, model_help: str) -> None:
    """The flags ``serve`` and ``mcp --http`` share: the models, where to listen, who may call (key, ``Host``,
    ``Origin``), the connection limits, threads, the state cache, confidence, dtype / device, media limits and the
    air gap. :func:`server_config` turns them into a :class:`ServerConfig`."""
    from clef_local.options import (
        add_confidence_flag,
        add_max_length_flag,
        add_media_flags,
        add_network_flag,
        add_runtime_flags,
    )

    parser.add_argument("--model", action="append", metavar="NAME=DIR", help=model_help)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=port, help=f"port (default {port})")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: no auth)")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="also answer requests whose Host is NAME (repeatable; localhost, 127.0.0.1, [::1] and "
                             "the --host address always are); any other Host gets 400")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="let web pages from ORIGIN (e.g. http://localhost:3000) call the API (repeatable; "
                             "default: no web page may, and no CORS headers are sent)")
    parser.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S, metavar="S",
                        help=f"seconds a client has to send a request's headers (default {HEADER_TIMEOUT_S:g})")
    parser.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="S",
                        help=f"seconds a client has to send a request's body (default {BODY_TIMEOUT_S:g})")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                        help=f"open connections at most; more get 503 (default {MAX_CONNECTIONS})")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="intra-op threads of the inference thread (default: physical cores − 1, or "
                             "$CLEF_LOCAL_THREADS / $OMP_NUM_THREADS; docs/hardware.md#threads)")
    parser.add_argument("--state-cache", metavar="SIZE", type=_state_cache_size, default=None,
                        help="memory per model for cached states (512MiB, 2GiB; 0: off; default: sized from the free "
                             "memory): a second schema on the same state runs only its own tokens (torch only)")
    add_confidence_flag(parser)
    add_max_length_flag(parser)
    add_runtime_flags(parser, backend=False, offload="none")
    add_media_flags(parser)
    add_network_flag(parser)


def server_config(args: argparse.Namespace, **settings: Any) -> ServerConfig:
    """The :class:`ServerConfig` of :func:`add_server_flags`' flags on ``args``, and ``settings`` (the batching
    flags of ``serve``, the aliases): the checks of ``ServerConfig`` name the bad flag."""
    return ServerConfig(host=args.host, port=args.port, api_key=args.api_key, confidence=args.confidence,
                        allowed_hosts=tuple(args.allowed_host), cors_origins=tuple(args.cors_origin),
                        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                        max_connections=args.max_connections, threads=args.threads, state_cache=args.state_cache,
                        **settings)


def main(argv: list[str] | None = None) -> int:
    """Serve the SystemOne HTTP API (POST /v1/systemone) with dynamic batching."""
    from clef_local.options import media_limits

    parser = argparse.ArgumentParser(prog="clef-local serve", description=main.__doc__)
    add_server_flags(parser, port=8077, model_help="a release to serve under NAME (repeatable; the first also "
                     "answers the Jev aliases jev-latest and jev-preview); default: the built-in default model as "
                     "clef-local")
    parser.add_argument("--max-batch", type=int, default=8, help="most requests in one batch (1: no batching)")
    parser.add_argument("--max-wait-ms", type=float, default=5.0,
                        help="how long a batch waits for more requests after its first (default 5)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="most requests waiting; beyond it the server answers 429 with Retry-After")
    args = parser.parse_args(argv)
    require_serve_extra()  # before the models load: a missing extra is a one-line error, not minutes later

    from clef_local.airgap import airgap

    with airgap(not args.allow_network):  # loopback and the listening socket stay allowed
        return serve(args.model or (), host=args.host, port=args.port, api_key=args.api_key,
                     max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, max_queue=args.max_queue,
                     confidence=args.confidence, dtype=args.dtype, state_cache=args.state_cache,
                     device=None if args.device == "auto" else args.device, media_limits=media_limits(args),
                     log_level="debug" if logging.getLogger().getEffectiveLevel() <= logging.DEBUG else "info",
                     allowed_hosts=args.allowed_host, cors_origins=args.cors_origin,
                     header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                     max_connections=args.max_connections, threads=args.threads, max_length=args.max_length,
                     offload=args.offload)


def _state_cache_size(text: str) -> int | None:
    from clef_local.runtime.state_cache import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


class ThreadedServer:
    """A uvicorn server on a background thread, for tests and benchmarks (loopback, free port by default).

    >>> with ThreadedServer(app) as server:
    ...     httpx.get(server.url + "/health")
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, graceful_timeout_s: int = 30,
                 config: ServerConfig | None = None) -> None:
        """``config``: the deadlines and connection cap to run with (default: those of ``create_app``'s app)."""
        import uvicorn

        options = uvicorn_options(config or app.state.clef.config)
        options["timeout_graceful_shutdown"] = graceful_timeout_s
        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on", **options)
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
