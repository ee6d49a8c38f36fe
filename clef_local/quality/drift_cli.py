"""``clef-local drift``: a variant's probabilities against its reference, as a gate (exit code) and a report.

Without ``--data`` the built-in probe set is used. Every figure carries its interval (``--confidence``,
``--resamples``, ``--seed``); with several ``--candidate``s the first table says which is closer and whether the
difference is significant. The gate syntax (``flips<=0.02@upper95``), the metrics it takes and the exit codes (0 pass,
1 a gate fails, 2 bad input): docs/quality.md#drift.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

from clef_local.batch.ray_runner import RaySettings, add_ray_flags
from clef_local.options import add_network_flag, add_runtime_flags
from clef_local.quality.drift import drift_from_predictions, head_difference
from clef_local.quality.gates import Gate, GateSyntaxError, Lookup, bound_of
from clef_local.quality.gates import parse_gates as _parse
from clef_local.quality.intervals import IntervalSettings, add_interval_flags, interval_settings
from clef_local.quality.metrics import LABEL_DELTAS
from clef_local.quality.results import DriftResult
from clef_local.runtime.schema import QUESTION_TYPES

__all__ = ["Gate", "GateSyntaxError", "drift_lookup", "main", "parse_gates"]

_ALIASES = {"flips": "flip_rate", "flip_count": "flips", "kl": "kl_mean", "js": "js_mean"}
SUMMARY_METRICS = ("kl_mean", "kl_p50", "kl_p99", "kl_max", "js_mean", "max_abs_max", "max_abs_mean", "rms_mean",
                   "flip_rate", "flips", "score_shift_mean", "score_shift_mean_abs")
# the metrics with an interval (quality/drift.py summary_intervals and labelled_metrics): @upper95 / @lower95
BOUNDED = ("kl_mean", "js_mean", "max_abs_mean", "rms_mean", "flip_rate", "score_shift_mean", "score_shift_mean_abs",
           *(f"delta_{m}" for m in LABEL_DELTAS))
SCOPES = (*QUESTION_TYPES, "all")


def parse_gates(text: str | None, level: str = "95") -> list[Gate]:
    """``"flips<=0.01,kl_mean<=0.002@upper95"`` → gates; :class:`GateSyntaxError` names the bad part and the
    metrics. ``level``: the run's interval level in percent (``@upper95`` must name it)."""
    known = (*SUMMARY_METRICS, *(f"delta_{m}" for m in LABEL_DELTAS))
    return _parse(text, metrics=known, scopes=SCOPES, aliases=_ALIASES, bounded=BOUNDED, level=level,
                  example="flips<=0.01, choice.kl_mean<0.002, flips<=0.02@upper95")


def drift_lookup(result: DriftResult) -> Lookup:
    """A gate's value in one drift result: the point value, or an end of its interval."""

    def lookup(kind: str | None, metric: str, bound: str | None) -> float | None:
        if metric.startswith("delta_"):
            entry = result.labelled.get(kind or "all")
            if not entry:
                return None
            name = metric[len("delta_"):]
            if bound is None:
                return entry["delta"].get(name)
            return bound_of(entry.get("intervals", {}).get("delta", {}).get(name), bound)
        if bound is not None:
            return bound_of(result.intervals.get(kind or "all", {}).get(metric), bound)
        summary = result.summary if kind in (None, "all") else result.by_type.get(kind or "", {})
        return summary.get(metric)

    return lookup


def _progress(desc: str, total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="req", desc=desc, disable=not enabled, file=sys.stderr)


def _run(path: str | Path, requests: list[dict[str, Any]], *, dtype: str | None, backend: str, device: str,
         batch_size: int, desc: str, show: bool, ray: RaySettings | None = None, airgapped: bool = True) -> list[Any]:
    import clef_local
    from clef_local.batch.ray_runner import RayPredictor

    options: dict[str, Any] = {"dtype": dtype, "backend": backend, "device": device}
    model = (RayPredictor(path, ray, load_options=options, airgapped=airgapped) if ray
             else clef_local.load(path, dtype=dtype, backend=backend, device=device))
    bar = _progress(desc, len(requests), show)
    try:
        return model.predict(requests, batch_size=batch_size, progress=lambda d, _t: bar.update(d - bar.n))
    finally:
        bar.close()
        del model
        gc.collect()  # one model in memory at a time: the reference's probabilities are kept, not the model


def _floor_dtype(dtype: str | None) -> str:
    return "bfloat16" if dtype == "float32" else "float32"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clef-local drift", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="the reference release (BF16)")
    parser.add_argument("--candidate", action="append", required=True, help="a variant to compare (repeatable)")
    parser.add_argument("--data", type=Path, help="labelled or plain request JSONL (default: the built-in probe set)")
    parser.add_argument("--limit", type=int, help="first N requests (probe set: N requests, default 64)")
    parser.add_argument("--gate", help='e.g. "flips<=0.01,kl_mean<=0.002@upper95"; exit 1 when one fails')
    parser.add_argument("--floor", action="store_true",
                        help="also run the reference against itself in another dtype (or --floor-backend)")
    parser.add_argument("--floor-dtype", choices=["float32", "bfloat16", "float16"],
                        help="the noise floor's dtype (default: float32, or bfloat16 when --dtype is float32)")
    parser.add_argument("--floor-backend", choices=["torch", "mlx", "onnx"], help="the noise floor's backend")
    add_interval_flags(parser)
    add_runtime_flags(parser)  # every model (reference, candidates) runs with the same ones
    parser.add_argument("--batch-size", type=int, default=8, help="requests per forward pass (default 8)")
    parser.add_argument("--report", type=Path, help="write the HTML report")
    parser.add_argument("--json", type=Path, help="write the results as JSON (re-render with clef-local report)")
    parser.add_argument("--md", type=Path, help="write the tables as Markdown")
    add_network_flag(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_ray_flags(parser)  # --ray: every model's predictions from Ray replicas (docs/batch.md)
    return parser


def _requests(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str]:
    if args.data:
        from clef_local.data.jsonl import read_jsonl

        examples = read_jsonl(args.data, limit=args.limit)
        if not examples:
            raise ValueError(f"{args.data}: no requests")
        labels = [e.labels for e in examples]
        return [e.request for e in examples], (labels if any(labels) else None), str(args.data)
    from clef_local.data.probes import probe_requests

    n = args.limit or 64
    return probe_requests(n), None, f"built-in probe set ({n} requests)"


def main(argv: list[str] | None = None) -> int:
    """Run the drift check; exit 0 (gates pass), 1 (a gate fails) or 2 (bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be ≥ 1, got {args.batch_size}")
    if args.report:  # before a model is loaded: a missing extra must not cost the whole run
        from clef_local.quality.plots import require_matplotlib

        require_matplotlib()
    try:
        settings = interval_settings(args)
        gates = parse_gates(args.gate, settings.percent)
    except ValueError as exc:  # GateSyntaxError included
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from clef_local.airgap import airgap
    from clef_local.data.jsonl import DataFormatError
    from clef_local.errors import ClefError

    dtype = None if args.dtype == "auto" else args.dtype
    show = not args.no_progress
    common = {"backend": args.backend, "device": args.device, "batch_size": args.batch_size, "show": show,
              "airgapped": not args.allow_network}
    try:
        from clef_local.batch.ray_runner import ray_settings

        common["ray"] = ray_settings(args)
        with airgap(not args.allow_network) as network:
            requests, labels, source = _requests(args)
            meta = {"network": network, "data": source, "dtype": args.dtype, "requests": len(requests)}
            ref = _run(args.reference, requests, dtype=dtype, desc="reference", **common)
            results = []
            for candidate in args.candidate:
                if (difference := head_difference(args.reference, candidate)) is not None:
                    print(f"warning: {difference}", file=sys.stderr)
                cand = _run(candidate, requests, dtype=dtype, desc=Path(candidate).name, **common)
                results.append(drift_from_predictions(ref, cand, requests, labels=labels,
                                                      reference_name=str(args.reference), candidate_name=str(candidate),
                                                      meta={**meta, "head": difference or "same as the reference's"},
                                                      intervals=settings))
            floor = None
            if args.floor:
                floor_dtype = args.floor_dtype or _floor_dtype(dtype)
                floor_common = {**common, "backend": args.floor_backend or args.backend}
                other = _run(args.reference, requests, dtype=floor_dtype, desc="noise floor", **floor_common)
                label = f"{Path(args.reference).name} ({floor_dtype}, {floor_common['backend']})"
                floor = drift_from_predictions(ref, other, requests, labels=labels, candidate_name=label,
                                               reference_name=str(args.reference), meta=meta, intervals=settings)
    except (ClefError, DataFormatError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _finish(args, results, floor, gates, network, settings)


def _finish(args: argparse.Namespace, results: list[DriftResult], floor: DriftResult | None, gates: list[Gate],
            network: str, settings: IntervalSettings) -> int:
    from clef_local.quality.compare import compare_candidates
    from clef_local.quality.report import (
        bundle_json,
        comparison_table_rows,
        drift_table_rows,
        labelled_table_rows,
        markdown_table,
        render_markdown,
        write_report,
    )

    failed = []
    for result in results:
        result.meta["gates"] = [gate.evaluate(drift_lookup(result)) for gate in gates]
        failed += [(result.candidate, g) for g in result.meta["gates"] if not g["ok"]]
    comparison = compare_candidates(results, settings)
    if comparison:  # the same for every candidate: kept with the first, where `report` finds it again
        results[0].meta["comparison"] = comparison
    print(f"network: {network}")
    if comparison:
        print(markdown_table(comparison_table_rows(comparison)))
        print()
    print(markdown_table(drift_table_rows(results, floor)))
    if any(r.labelled for r in results):
        print()
        print(markdown_table(labelled_table_rows(results)))
    if args.report:
        write_report(results, args.report, floor=floor, network=network)
        print(f"report: {args.report}")
    if args.md:
        args.md.write_text(render_markdown(results, floor=floor, network=network), encoding="utf-8")
    if args.json:
        args.json.write_text(json.dumps(bundle_json(results, floor=floor, network=network)) + "\n", encoding="utf-8")
    for candidate, gate in failed:
        value = "not measured" if gate["value"] is None else f"{gate['value']:.6g}"
        print(f"gate failed: {Path(candidate).name}: {gate['expr']} (measured {value})", file=sys.stderr)
    if gates and not failed:
        print(f"gates passed: {', '.join(g.expr for g in gates)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

