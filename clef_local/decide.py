"""``clef-local decide`` (answer one request) and ``clef-local inspect`` (what a release holds and how it runs)."""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from clef_local.errors import ApiUsageError
from clef_local.options import add_confidence_flag, add_model_flags, add_network_flag, load_options, model_path

EXAMPLES = ("triage", "moderation", "routing")


def read_request(source: str | None, example: str | None) -> Any:
    """The request JSON from a built-in example, a file, or standard input (``-``)."""
    if example:
        return json.loads(resources.files("clef_local.demo.examples").joinpath(f"{example}.json").read_text())
    if source is None:
        raise ApiUsageError("give a request: --request FILE (- for standard input) or --example NAME")
    text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiUsageError(f"{source}: not valid JSON ({exc})") from exc


def main(argv: list[str] | None = None) -> int:
    """Answer one SystemOne request and print the response JSON."""
    parser = argparse.ArgumentParser(prog="clef-local decide", description=main.__doc__)
    add_model_flags(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--request", help="request JSON file, or - for standard input")
    source.add_argument("--example", choices=EXAMPLES, help="a built-in example request")
    add_confidence_flag(parser)
    parser.add_argument("--truncate-state", action="store_true",
                        help="drop the end of a state that does not fit instead of failing")
    parser.add_argument("--full-precision", action="store_true", help="do not round floats to 4 decimals")
    add_network_flag(parser)
    args = parser.parse_args(argv)

    import clef_local
    from clef_local.airgap import airgap
    from clef_local.runtime.answers import round_floats

    request = read_request(args.request, args.example)
    with airgap(not args.allow_network):
        model = clef_local.load(model_path(args.model), confidence=args.confidence, **load_options(args))
        response = model.decide(request, truncate_state=args.truncate_state)
    if not args.full_precision:
        response = round_floats(response, 4)
    print(json.dumps(response, ensure_ascii=False, indent=2))
    return 0


def inspect_main(argv: list[str] | None = None) -> int:
    """Print what a release holds and how it would run here (backend, device, dtype, kernels)."""
    parser = argparse.ArgumentParser(prog="clef-local inspect", description=inspect_main.__doc__)
    add_model_flags(parser)
    args = parser.parse_args(argv)

    import clef_local

    model = clef_local.load(model_path(args.model), **load_options(args))
    print(json.dumps(model.describe(), indent=2))
    return 0
