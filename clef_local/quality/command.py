"""What the quality commands that gate (``drift``, ``probe``) share around their own work: the request flags and the
output flags, the checks before a model is loaded (batch size, the report's extra, the interval settings and the
gates), the requests (``--data`` or the built-in probe set), the errors that exit 2, and the ending (the files
written, each failed gate named, exit 1 when one fails). docs/quality.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_local.data.jsonl import DataFormatError
from clef_local.errors import ClefError
from clef_local.options import add_network_flag
from clef_local.quality.gates import Gate
from clef_local.quality.intervals import IntervalSettings, interval_settings

if TYPE_CHECKING:
    from clef_local.quality.results import DriftResult, ProbeResult

# bad input, found before or while the models run: one line on stderr and exit 2
INPUT_ERRORS = (ClefError, DataFormatError, ValueError, FileNotFoundError)
PROBE_SET = 64


def add_request_flags(parser: argparse.ArgumentParser, *, data: str, limit: str) -> None:
    """``--data`` and ``--limit``, with the command's own help."""
    parser.add_argument("--data", type=Path, help=data)
    parser.add_argument("--limit", type=int, help=limit)


def add_output_flags(parser: argparse.ArgumentParser, *, report: str, json_: str, md: str, progress: str) -> None:
    """``--batch-size``, ``--report``, ``--json``, ``--md``, ``--allow-network``, ``--no-progress``."""
    parser.add_argument("--batch-size", type=int, default=8, help="requests per forward pass (default 8)")
    parser.add_argument("--report", type=Path, help=report)
    parser.add_argument("--json", type=Path, help=json_)
    parser.add_argument("--md", type=Path, help=md)
    add_network_flag(parser)
    parser.add_argument("--no-progress", action="store_true", help=progress)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments, ``--batch-size`` checked (a usage error otherwise)."""
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be ≥ 1, got {args.batch_size}")
    return args


def settings_and_gates(args: argparse.Namespace, parse_gates: Callable[[str | None, str], list[Gate]]
                       ) -> tuple[IntervalSettings, list[Gate]] | None:
    """Before any model loads: the report's extra (a missing one must not cost the whole run), the interval
    settings and ``--gate`` parsed at their level. None (the error printed) when one is bad: exit 2."""
    if args.report:
        from clef_local.quality.plots import require_matplotlib

        require_matplotlib()
    try:
        settings = interval_settings(args)
        return settings, parse_gates(args.gate, settings.percent)
    except ValueError as exc:  # GateSyntaxError included
        print(f"error: {exc}", file=sys.stderr)
        return None


@dataclass(frozen=True)
class Requests:
    """The requests a command runs, their labels (None: unlabelled) and where they came from, for the tables."""

    requests: list[dict[str, Any]]
    labels: list[Any] | None
    source: str


def read_requests(args: argparse.Namespace, seed: int | None = None, *, validation: bool = False,
                  vision: bool = False) -> Requests:
    """``--data`` (its first ``--limit``) or ``--limit`` requests of the built-in probe set (default
    :data:`PROBE_SET`), drawn with ``seed`` (None: the set's default draw, not named in the source). ``validation``:
    the built-in set is export validation's (:func:`~clef_local.data.probes.validation_probes` from the packaged
    data, with image requests when ``vision``), so that a reference file saved on it validates an export; else
    :func:`~clef_local.data.probes.probe_requests`."""
    if args.data:
        from clef_local.data.jsonl import read_jsonl

        examples = read_jsonl(args.data, limit=args.limit)
        if not examples:
            raise ValueError(f"{args.data}: no requests")
        labels = [e.labels for e in examples]
        return Requests([e.request for e in examples], labels if any(labels) else None, str(args.data))
    from clef_local.data.probes import probe_requests, validation_probes

    n = args.limit or PROBE_SET
    named = "" if seed is None else f", seed {seed}"
    if validation:
        from clef_local.data.datasets import packaged_datasets_dir

        requests = validation_probes(n, seed or 0, vision=vision, root=packaged_datasets_dir())
        return Requests(requests, None, f"built-in probe set ({n} requests{named}{', with images' * vision})")
    return Requests(probe_requests(n, seed or 0), None, f"built-in probe set ({n} requests{named})")


def input_error(exc: BaseException) -> int:
    """One of :data:`INPUT_ERRORS` as the commands report it: one line on stderr, exit 2."""
    print(f"error: {exc}", file=sys.stderr)
    return 2


def write_outputs(args: argparse.Namespace, results: Sequence[DriftResult], network: str, *,
                  floor: DriftResult | None = None, probes: Sequence[ProbeResult] = ()) -> None:
    """``--report`` (named once written), ``--md`` and ``--json``."""
    from clef_local.quality.report import bundle_json, render_markdown, write_report

    if args.report:
        write_report(results, args.report, floor=floor, network=network, probes=probes)
        print(f"report: {args.report}")
    if args.md:
        args.md.write_text(render_markdown(results, floor=floor, network=network, probes=probes), encoding="utf-8")
    if args.json:
        args.json.write_text(json.dumps(bundle_json(results, floor=floor, network=network, probes=probes)) + "\n",
                             encoding="utf-8")


def gate_verdict(failed: Sequence[tuple[str, dict[str, Any]]], gates: Sequence[str]) -> int:
    """Each failed gate on stderr (after its prefix, e.g. the candidate's name), or every gate passed named; the
    exit code: 1 when one failed, else 0."""
    for prefix, gate in failed:
        value = "not measured" if gate["value"] is None else f"{gate['value']:.6g}"
        print(f"gate failed: {prefix}{gate['expr']} (measured {value})", file=sys.stderr)
    if gates and not failed:
        print(f"gates passed: {', '.join(gates)}")
    return 1 if failed else 0
