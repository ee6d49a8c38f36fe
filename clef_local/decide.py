"""``clef-local decide`` (answer one request) and ``clef-local inspect`` (what a release holds and how it runs)."""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from clef_local.errors import ApiUsageError
from clef_local.options import (
    add_confidence_flag,
    add_max_length_flag,
    add_media_flags,
    add_model_flags,
    add_network_flag,
    load_options,
    media_limits,
    model_path,
)

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


def read_media_files(images: list[str], videos: list[str]) -> dict[str, Any]:
    """``images`` / ``videos`` of a request from local files: each ``--image FILE``, each ``--video`` a directory of
    frames (in name order) or a comma-separated list of frame files. The bytes are decoded by the model, under its
    media limits; only the files named here are read."""
    def read(name: str) -> bytes:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ApiUsageError(f"{name}: no such image file")
        return path.read_bytes()

    out: dict[str, Any] = {}
    if images:
        out["images"] = [read(name) for name in images]
    if videos:
        clips = []
        for spec in videos:
            folder = Path(spec).expanduser()
            names = sorted(str(p) for p in folder.iterdir() if p.is_file()) if folder.is_dir() else spec.split(",")
            if not names:
                raise ApiUsageError(f"--video {spec}: the directory holds no frame files")
            clips.append([read(name) for name in names])
        out["videos"] = clips
    return out


def main(argv: list[str] | None = None) -> int:
    """Answer one SystemOne request and print the response JSON."""
    parser = argparse.ArgumentParser(prog="clef-local decide", description=main.__doc__)
    add_model_flags(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--request", help="request JSON file, or - for standard input")
    source.add_argument("--example", choices=EXAMPLES, help="a built-in example request")
    add_confidence_flag(parser)
    add_max_length_flag(parser)
    parser.add_argument("--truncate-state", action="store_true",
                        help="drop the end of a state that does not fit instead of failing")
    parser.add_argument("--full-precision", action="store_true", help="do not round floats to 4 decimals")
    parser.add_argument("--image", action="append", default=[], metavar="FILE",
                        help="an image file to add to the request's images (repeatable, in order, after any the "
                             "request JSON carries)")
    parser.add_argument("--video", action="append", default=[], metavar="FRAMES",
                        help="a video as frames: a directory of frame images (name order) or FILE,FILE,... "
                             "(repeatable; needs the video extra)")
    add_media_flags(parser)
    add_network_flag(parser)
    args = parser.parse_args(argv)

    import clef_local
    from clef_local.airgap import airgap
    from clef_local.runtime.answers import round_floats

    request = read_request(args.request, args.example)
    files = read_media_files(args.image, args.video)
    if files:
        if not isinstance(request, dict) or any(not isinstance(request.get(k) or [], list) for k in files):
            raise ApiUsageError("--image / --video need a request JSON object whose images / videos are arrays")
        request = {**request, **{k: [*(request.get(k) or []), *v] for k, v in files.items()}}
    with airgap(not args.allow_network):
        model = clef_local.load(model_path(args.model), confidence=args.confidence, media_limits=media_limits(args),
                                **load_options(args))
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
