"""``clef-local drift``: a variant's probabilities against its reference, as a gate (exit code) and a report.

Without ``--data`` the built-in probe set is used: export validation's (``clef_local.data.probes.validation_probes``,
image requests included for a model with a vision tower), so that ``--save-reference`` serves ``quantize
--reference-file``. Every figure carries its interval (``--confidence``,
``--resamples``, ``--seed``); with several ``--candidate``s the first table says which is closer and whether the
difference is significant. The gate syntax (``flips<=0.02@upper95``), the metrics it takes and the exit codes (0 pass,
1 a gate fails, 2 bad input): docs/quality.md#drift. A reference that does not fit in memory is streamed from disk
(``--offload``); ``--save-reference FILE`` keeps its probabilities and ``--reference-file FILE`` compares with them
without loading it (:mod:`clef_local.quality.reference_file`, docs/quality.md#reference-files).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_local.batch.ray_runner import RaySettings, add_ray_flags
from clef_local.options import add_max_length_flag, add_runtime_flags
from clef_local.quality import command
from clef_local.quality.command import add_output_flags, add_request_flags
from clef_local.quality.drift import drift_from_predictions, head_difference
from clef_local.quality.gates import Gate, GateSyntaxError, Lookup, bound_of
from clef_local.quality.gates import parse_gates as _parse
from clef_local.quality.intervals import IntervalSettings, add_interval_flags
from clef_local.quality.metrics import LABEL_DELTAS
from clef_local.quality.results import DriftResult
from clef_local.runtime.schema import QUESTION_TYPES

__all__ = ["Gate", "GateSyntaxError", "drift_lookup", "main", "parse_gates"]

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Run:
    """One model's predictions and what they were computed in (the dtype and context a reference file checks;
    None on Ray, where the replicas' models are not seen here)."""

    predictions: list[Any]
    dtype: str | None
    context: int | None


def _run(path: str | Path, requests: list[dict[str, Any]], *, dtype: str | None, backend: str, device: str,
         batch_size: int, desc: str, show: bool, ray: RaySettings | None = None, airgapped: bool = True,
         max_memory: str | None = None, offload: str = "auto", max_length: int | None = None) -> Run:
    import clef_local
    from clef_local.batch.ray_runner import RayPredictor

    options: dict[str, Any] = {"dtype": dtype, "backend": backend, "device": device, "offload": offload,
                               **({"max_memory": max_memory} if max_memory else {}),
                               **({"max_length": max_length} if max_length else {})}
    model = (RayPredictor(path, ray, load_options=options, airgapped=airgapped) if ray
             else clef_local.load(path, **options))
    decision = getattr(getattr(model, "backend", None), "load_decision", None)
    if decision is not None and decision.stream is not None:
        log.info("%s streamed from disk: %s", desc, decision.stream.summary())
    bar = _progress(desc, len(requests), show)
    try:
        predictions = model.predict(requests, batch_size=batch_size, progress=lambda d, _t: bar.update(d - bar.n))
        return Run(predictions, decision.dtype if decision is not None else dtype,
                   getattr(model, "max_length", None))
    finally:
        bar.close()
        del model
        gc.collect()  # one model in memory at a time: the reference's probabilities are kept, not the model


def _reads_images(args: argparse.Namespace) -> bool:
    """Whether the built-in probe set takes image requests: as export validation's does, when the models have a
    vision tower (run on the torch backend, the one that runs it), so that a ``--save-reference`` file made on it
    validates an export (``quantize --reference-file``). A missing config is the load's to report."""
    path = args.reference or next(iter(args.candidate), None)
    if args.data or path is None or args.backend not in ("auto", "torch"):
        return False
    config = Path(path) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text(encoding="utf-8"))


def _floor_dtype(dtype: str | None) -> str:
    return "bfloat16" if dtype == "float32" else "float32"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clef-local drift", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", help="the reference release (BF16); streamed from disk when it does not fit")
    parser.add_argument("--candidate", action="append", default=[],
                        help="a variant to compare (repeatable; none with --save-reference only)")
    parser.add_argument("--save-reference", type=Path, metavar="FILE",
                        help="write the reference's probabilities on these requests to FILE, for --reference-file "
                             "here or on another machine")
    parser.add_argument("--reference-file", type=Path, metavar="FILE",
                        help="compare with the probabilities in FILE (from --save-reference) instead of running the "
                             "reference; --dtype auto follows the file")
    add_request_flags(parser, data="labelled or plain request JSONL (default: the built-in probe set)",
                      limit="first N requests (probe set: N requests, default 64)")
    parser.add_argument("--gate", help='e.g. "flips<=0.01,kl_mean<=0.002@upper95"; exit 1 when one fails')
    parser.add_argument("--floor", action="store_true",
                        help="also run the reference against itself in another dtype (or --floor-backend)")
    parser.add_argument("--floor-dtype", choices=["float32", "bfloat16", "float16"],
                        help="the noise floor's dtype (default: float32, or bfloat16 when --dtype is float32)")
    parser.add_argument("--floor-backend", choices=["torch", "mlx", "onnx"], help="the noise floor's backend")
    add_interval_flags(parser)
    add_runtime_flags(parser, max_memory=True, offload="auto")  # every model (reference, candidates) runs with them
    add_max_length_flag(parser)
    add_output_flags(parser, report="write the HTML report",
                     json_="write the results as JSON (re-render with clef-local report)",
                     md="write the tables as Markdown", progress="no progress bars")
    add_ray_flags(parser)  # --ray: every model's predictions from Ray replicas (docs/batch.md)
    return parser


def _flag_problem(args: argparse.Namespace) -> str | None:
    """Why the reference flags do not go together (None: they do)."""
    if not args.reference and not args.reference_file:
        return "give the reference: --reference DIR (run here) or --reference-file FILE (from --save-reference)"
    if args.save_reference and (args.reference_file or not args.reference):
        return "--save-reference runs the reference: give --reference DIR, not --reference-file"
    if args.save_reference and args.ray:
        return ("--save-reference records the reference's dtype and context, which Ray replicas do not report: save "
                "it without --ray (the file then serves --reference-file runs on Ray)")
    if args.reference_file and args.floor:
        return "--floor runs the reference again in another dtype: give --reference DIR, not --reference-file"
    if not args.candidate and not args.save_reference:
        return "give at least one --candidate DIR to compare (or --save-reference FILE to only keep the reference)"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the drift check; exit 0 (gates pass), 1 (a gate fails) or 2 (bad input)."""
    args = command.parse(build_parser(), argv)
    if (checked := command.settings_and_gates(args, parse_gates)) is None:
        return 2
    settings, gates = checked
    from clef_local.airgap import airgap

    if problem := _flag_problem(args):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    dtype = None if args.dtype == "auto" else args.dtype
    show = not args.no_progress
    common = {"backend": args.backend, "device": args.device, "batch_size": args.batch_size, "show": show,
              "airgapped": not args.allow_network, "max_memory": args.max_memory, "offload": args.offload,
              "max_length": args.max_length}
    try:
        from clef_local.batch.ray_runner import ray_settings
        from clef_local.quality import reference_file

        common["ray"] = ray_settings(args)
        with airgap(not args.allow_network) as network:
            read = command.read_requests(args, validation=True, vision=_reads_images(args))
            requests, labels, source = read.requests, read.labels, read.source
            stored = None
            if args.reference_file:  # checked before any model loads: a wrong file costs nothing
                stored = reference_file.read(args.reference_file)
                reference_file.check_requests(stored, requests, source)
                if args.reference:
                    reference_file.check_reference(stored, args.reference)
                dtype = dtype or stored.dtype  # --dtype auto follows the file; another one is refused now
                reference_file.check_run(stored, dtype=dtype, context=None)
                print(f"reference: {args.reference_file}: {stored.describe()}")
            reference_name = stored.reference["path"] if stored else str(args.reference)
            meta = {"network": network, "data": source, "dtype": args.dtype, "requests": len(requests)}
            ref = None
            if stored is None:
                live = _run(args.reference, requests, dtype=dtype, desc="reference", **common)
                ref = live.predictions
                if args.save_reference:
                    saved = reference_file.from_predictions(
                        ref, requests, reference_dir=args.reference, dtype=live.dtype or args.dtype,
                        context=live.context or 0, meta={"data": source, "backend": args.backend,
                                                         "device": args.device})
                    reference_file.write(saved, args.save_reference)
                    print(f"reference saved: {args.save_reference}: {saved.describe()}")
            results = []
            for candidate in args.candidate:
                difference = (reference_file.check_candidate(stored, candidate) if stored
                              else head_difference(args.reference, candidate))
                if difference is not None:
                    print(f"warning: {difference}", file=sys.stderr)
                cand = _run(candidate, requests, dtype=dtype, desc=Path(candidate).name, **common)
                if stored is not None:
                    reference_file.check_run(stored, dtype=cand.dtype or stored.dtype, context=cand.context)
                against = (reference_file.predictions_for(stored, cand.predictions) if stored is not None
                           else ref or [])
                results.append(drift_from_predictions(against, cand.predictions, requests, labels=labels,
                                                      reference_name=reference_name, candidate_name=str(candidate),
                                                      meta={**meta, "head": difference or "same as the reference's"},
                                                      intervals=settings))
            floor = None
            if args.floor and ref is not None:
                floor_dtype = args.floor_dtype or _floor_dtype(dtype)
                floor_common = {**common, "backend": args.floor_backend or args.backend}
                other = _run(args.reference, requests, dtype=floor_dtype, desc="noise floor", **floor_common)
                label = f"{Path(args.reference).name} ({floor_dtype}, {floor_common['backend']})"
                floor = drift_from_predictions(ref, other.predictions, requests, labels=labels, candidate_name=label,
                                               reference_name=str(args.reference), meta=meta, intervals=settings)
    except command.INPUT_ERRORS as exc:
        return command.input_error(exc)
    if not results and floor is None:  # --save-reference alone
        return 0
    return _finish(args, results, floor, gates, network, settings)


def _finish(args: argparse.Namespace, results: list[DriftResult], floor: DriftResult | None, gates: list[Gate],
            network: str, settings: IntervalSettings) -> int:
    from clef_local.quality.compare import compare_candidates
    from clef_local.quality.report import comparison_table_rows, drift_table_rows, labelled_table_rows, markdown_table

    failed = []
    for result in results:
        result.meta["gates"] = [gate.evaluate(drift_lookup(result)) for gate in gates]
        failed += [(f"{Path(result.candidate).name}: ", g) for g in result.meta["gates"] if not g["ok"]]
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
    command.write_outputs(args, results, network, floor=floor)
    return command.gate_verdict(failed, [g.expr for g in gates])


if __name__ == "__main__":
    sys.exit(main())

