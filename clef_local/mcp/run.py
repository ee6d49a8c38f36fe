"""``clef-local mcp``: load the models, then serve the tools over stdio (what desktop agent hosts launch) or, with
``--http``, over streamable HTTP on loopback; air-gapped like ``serve``. docs/mcp.md."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import sys
from typing import Any

from clef_local.errors import ApiUsageError
from clef_local.mcp.states import DEFAULT_BUDGET
from clef_local.server.config import DEFAULT_NAME, ServerConfig, bind_warning, parse_model_specs
from clef_local.server.run import add_server_flags, load_models, server_config, uvicorn_options
from clef_local.units import parse_size

log = logging.getLogger(__name__)
DEFAULT_PORT = 8078  # serve's is 8077: both can run side by side


def require_mcp_extra() -> None:
    """Fail at once, before any model loads, when the ``mcp`` extra is not installed (one line, exit status 2)."""
    try:
        missing = importlib.util.find_spec("mcp") is None
    except ValueError:  # a module named mcp without a spec (a stub left in sys.modules)
        missing = True
    if missing:
        raise ApiUsageError("clef-local mcp needs the MCP SDK, which is not installed: pip install 'clef-local[mcp]'")


def load_tools(args: argparse.Namespace, config: ServerConfig) -> Any:
    """The :class:`~clef_local.mcp.server.ClefTools` of the parsed flags: the ``--model`` releases (or the default
    model), loaded with stdout pointed at stderr, since on stdio stdout is the protocol's."""
    from clef_local.mcp.server import ClefTools
    from clef_local.options import media_limits

    if args.model:
        specs = parse_model_specs(args.model)
    else:
        from clef_local.demo.default import default_model_path

        specs = {DEFAULT_NAME: default_model_path()}
    with contextlib.redirect_stdout(sys.stderr):
        models = load_models(specs, dtype=None if args.dtype in (None, "auto") else args.dtype,
                             device=None if args.device == "auto" else args.device, confidence=args.confidence,
                             media_limits=media_limits(args), state_cache=config.state_cache,
                             max_length=args.max_length, offload=args.offload)
    return ClefTools(models, config, remember=args.remember)


async def serve_stdio(tools: Any) -> None:
    """Serve ``tools`` over this process's stdin and stdout until the host closes stdin."""
    from mcp.server.stdio import stdio_server

    from clef_local.mcp.server import build_server

    server = build_server(tools)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def serve_http(tools: Any, config: ServerConfig, log_level: str = "info") -> None:
    """Serve ``tools`` over streamable HTTP at ``http://HOST:PORT/mcp`` until interrupted."""
    import uvicorn

    from clef_local.mcp.http import MCP_PATH, create_http_app

    if warning := bind_warning(config.host, config.api_key):
        print(warning.replace("clef-local serve", "clef-local mcp"), file=sys.stderr)
    host = f"[{config.host}]" if ":" in config.host else config.host
    log.info("MCP over streamable HTTP at http://%s:%d%s", host, config.port, MCP_PATH)
    uvicorn.run(create_http_app(tools, config), host=config.host, port=config.port, log_level=log_level,
                **uvicorn_options(config))


def main(argv: list[str] | None = None) -> int:
    """Serve Clef models as MCP tools (decide, ask_yes_no, choose, rate, ask_again, models) for agents: over stdio
    by default, over streamable HTTP with --http."""
    parser = argparse.ArgumentParser(prog="clef-local mcp", description=main.__doc__)
    add_server_flags(parser, port=DEFAULT_PORT, model_help="a release to serve under NAME (repeatable; a bare DIR "
                     "is served as clef-local; the first is the default of calls that name no model); default: "
                     "the built-in default model as clef-local")
    parser.add_argument("--http", action="store_true",
                        help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio (the --host, --port, "
                             "--api-key, --allowed-host, --cors-origin, timeout and connection flags apply to it)")
    parser.add_argument("--remember", metavar="SIZE", type=_size, default=DEFAULT_BUDGET,
                        help="memory for the states ask_again can refer to (their text and images, most recent "
                             "kept; default 64MiB; 0: ask_again knows none)")
    args = parser.parse_args(argv)
    require_mcp_extra()
    config = server_config(args, aliases=())
    from clef_local.airgap import airgap

    with airgap(not args.allow_network):  # loopback and the listening socket stay allowed
        tools = load_tools(args, config)
        if args.http:
            serve_http(tools, config, "debug" if logging.getLogger().getEffectiveLevel() <= logging.DEBUG
                       else "info")
        else:
            import anyio

            log.info("MCP over stdio: %s", ", ".join(tools.models))
            anyio.run(serve_stdio, tools)
    return 0


def _size(text: str) -> int:
    try:
        return parse_size(text, what="--remember")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
