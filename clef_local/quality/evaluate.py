"""``clef-local eval``: a model on labelled requests, offline. Per question type, accuracy, macro-F1, NLL, Brier, ECE
and adaptive ECE (:mod:`clef_local.quality.metrics`) with their intervals (a bootstrap over requests; the error rate's
exact binomial bounds: :mod:`clef_local.quality.intervals`), and each batch's latency and throughput; with
``--error-budget`` the confidence threshold per type that keeps the error within it (:mod:`.selective`), and the
coverage and error at the thresholds a calibrated model stores (docs/quality.md#eval).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clef_local.batch.ray_runner import add_ray_flags
from clef_local.data.datasets import Example
from clef_local.options import add_model_flags, add_network_flag, load_options, model_path
from clef_local.quality.intervals import (
    DEFAULT_INTERVALS,
    IntervalSettings,
    LabelledQuestions,
    RequestBootstrap,
    add_interval_flags,
    as_list,
    error_rate_interval,
    interval_settings,
    labelled_samples,
)
from clef_local.quality.metrics import labelled_report
from clef_local.quality.results import EvalResult, EvalRow, gold_index
from clef_local.quality.selective import BOUNDS, Question, apply_thresholds, error_budget
from clef_local.runtime.schema import QUESTION_TYPES

if TYPE_CHECKING:
    from clef_local.batch.ray_runner import RayPredictor
    from clef_local.model import ClefModel, Prediction

log = logging.getLogger(__name__)


def metrics_by_type(rows: Sequence[EvalRow]) -> dict[str, dict[str, float]]:
    """:func:`clef_local.quality.metrics.labelled_report` per question type present, and over all questions."""
    out = {}
    for kind in (*QUESTION_TYPES, "all"):
        chosen = [r for r in rows if kind in ("all", r.kind)]
        if chosen:
            out[kind] = labelled_report([np.asarray(r.probs) for r in chosen], [r.gold for r in chosen],
                                        [r.options for r in chosen])
    return out


def request_ids(rows: Sequence[EvalRow]) -> list[int]:
    """Each row's request for the bootstrap; rows saved without one (``-1``) count as a request each."""
    return [r.request if r.request >= 0 else -1 - n for n, r in enumerate(rows)]


def intervals_by_type(rows: Sequence[EvalRow], settings: IntervalSettings) -> dict[str, dict[str, list[Any]]]:
    """Every metric's interval per type and overall: the bootstrap over requests (accuracy, macro-F1, NLL, Brier,
    ECE, adaptive ECE, confidence) and ``error_rate``'s exact binomial bounds."""
    if not rows:
        return {}
    boot = RequestBootstrap(request_ids(rows), settings)
    questions = LabelledQuestions.build([r.probs for r in rows], [r.gold for r in rows], [r.options for r in rows])
    kinds = np.array([r.kind for r in rows])
    out = {}
    for kind in (*QUESTION_TYPES, "all"):
        mask = np.ones(len(rows), bool) if kind == "all" else kinds == kind
        if mask.any():
            entry = {k: as_list(boot.interval(v)) for k, v in labelled_samples(boot, questions, mask).items()}
            entry["error_rate"] = as_list(error_rate_interval(questions.correct[mask].astype(bool),
                                                              settings.confidence))
            out[kind] = entry
    return out


def selective_questions(rows: Sequence[EvalRow]) -> list[Question]:
    """``(type, top probability, correct)`` per labelled question, as :mod:`clef_local.quality.selective` takes them."""
    return [(r.kind, float(max(r.probs)), int(np.argmax(r.probs)) == r.gold) for r in rows]


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=float) * 1e3
    return {f"p{q}_ms": float(np.percentile(arr, q)) for q in (50, 90, 99)} if len(arr) else {}


def _progress_bar(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="req", disable=not enabled, file=sys.stderr, desc="eval")


def evaluate(model: ClefModel | RayPredictor, examples: Sequence[Example], *, batch_size: int = 8,
             data_name: str = "", progress: Callable[[int, int], None] | None = None,
             intervals: IntervalSettings | None = DEFAULT_INTERVALS) -> tuple[EvalResult, list[Prediction]]:
    """Run labelled examples through ``model`` (or a Ray actor pool); metrics per type (with their intervals unless
    ``intervals`` is None), latency and throughput; the coverage and error at the model's stored thresholds."""
    requests = [e.request for e in examples]
    started = time.perf_counter()
    batch_times: list[float] = []
    predictions = model.predict(requests, batch_size=batch_size, progress=progress, batch_seconds=batch_times)
    wall = time.perf_counter() - started
    rows = []
    for n, (example, pred) in enumerate(zip(examples, predictions, strict=True)):
        for question, p in zip(pred.encoded.questions, pred.probabilities, strict=True):
            if question.question_id in example.labels:
                k = len(question.option_ids)
                rows.append(EvalRow(QUESTION_TYPES[question.question_type], list(question.option_ids),
                                    [float(x) for x in p[:k]],
                                    gold_index(question.option_ids, example.labels[question.question_id]), n))
    questions = sum(len(p.encoded.questions) for p in predictions)
    tokens = sum(len(p.encoded.input_ids) for p in predictions)
    compute = sum(batch_times)
    speed = {"batch_size": float(batch_size), "wall_s": wall, "compute_s": compute,
             "requests_per_s": len(requests) / compute if compute else float("nan"),
             "questions_per_s": questions / compute if compute else float("nan"),
             "tokens_per_s": tokens / compute if compute else float("nan"),
             "ms_per_request": 1e3 * compute / max(len(requests), 1), **_percentiles(batch_times)}
    level = (intervals or DEFAULT_INTERVALS).confidence
    thresholds = getattr(model, "thresholds", None) or {}
    selective = {"stored": {"thresholds": dict(thresholds), "confidence": level,
                            "types": apply_thresholds(selective_questions(rows), thresholds, level)}} if thresholds \
        else {}
    result = EvalResult(model=str(model.path), data=data_name, requests=len(requests), questions=questions,
                        metrics=metrics_by_type(rows), speed=speed, rows=rows,
                        meta={"labelled_questions": len(rows), "tokens": tokens,
                              **({"intervals": intervals.to_json()} if intervals is not None else {})},
                        intervals=intervals_by_type(rows, intervals) if intervals is not None else {},
                        selective=selective)
    return result, predictions


def _cell(value: float, interval: Sequence[Any] | None, width: int, digits: int = 3) -> str:
    text = f"{value:.{digits}f}"
    if interval and interval[0] is not None and interval[1] is not None:
        text += f" [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"
    return f"{text:>{width}}"


def format_metrics(result: EvalResult) -> str:
    """A plain-text table: one line per type, each figure with its interval when it has one."""
    level = result.meta.get("intervals", {}).get("confidence")
    width = 21 if result.intervals else 6
    names = ("acc", "F1", "NLL", "Brier", "ECE", "aECE")
    lines = [f"{'type':<7} {'n':>6} " + " ".join(f"{name:>{width}}" for name in names)]
    for kind, m in result.metrics.items():
        iv = result.intervals.get(kind, {})
        cells = [_cell(m[key], iv.get(key), width) for key in ("accuracy", "macro_f1", "nll", "brier", "ece",
                                                               "adaptive_ece")]
        lines.append(f"{kind:<7} {m['n']:>6} " + " ".join(cells))
    if level is not None:
        lines.append(f"[low, high]: {level:.0%} intervals, a bootstrap over requests "
                     f"({result.meta['intervals']['resamples']} resamples, seed {result.meta['intervals']['seed']})")
    s = result.speed
    lines.append(f"{result.requests} requests, {result.questions} questions in {s['compute_s']:.1f} s: "
                 f"{s['requests_per_s']:.2f} req/s, {s['tokens_per_s']:.0f} tok/s, batch p50 "
                 f"{s.get('p50_ms', float('nan')):.0f} ms p90 {s.get('p90_ms', float('nan')):.0f} ms (batch size "
                 f"{int(s['batch_size'])})")
    return "\n".join(lines)


def _write_predictions(path: Path, examples: Sequence[Example], predictions: Sequence[Prediction]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for example, pred in zip(examples, predictions, strict=True):
            line = {"id": example.id, "response": pred.response(), "labels": example.labels}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    """``clef-local eval``: metrics, latency and throughput of a model on labelled JSONL."""
    parser = argparse.ArgumentParser(prog="clef-local eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser, offload="auto")  # a model that does not fit is streamed: eval is a reference run
    parser.add_argument("--data", type=Path, required=True, help="labelled JSONL (see `clef-local data convert`)")
    parser.add_argument("--limit", type=int, help="first N requests only")
    parser.add_argument("--batch-size", type=int, default=8, help="requests per forward pass (default 8)")
    parser.add_argument("--out", type=Path, help="write each request's response and labels as JSONL")
    parser.add_argument("--report", type=Path, help="write an HTML report")
    parser.add_argument("--json", type=Path, help="write the metrics (and rows, for `clef-local report`) as JSON")
    add_interval_flags(parser)
    parser.add_argument("--error-budget", type=float, metavar="RATE",
                        help="the confidence threshold per question type that keeps the error at or under RATE "
                             "(e.g. 0.02), with the coverage there (docs/quality.md#selective-prediction)")
    parser.add_argument("--budget-bound", choices=BOUNDS, default="upper",
                        help="choose the threshold on the error's exact upper bound (default, a guarantee at "
                             "--confidence) or on the observed error (point)")
    add_network_flag(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_ray_flags(parser)
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be ≥ 1, got {args.batch_size}")
    try:
        settings = interval_settings(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.error_budget is not None and not 0 < args.error_budget < 1:
        parser.error(f"--error-budget must be a rate in (0, 1), got {args.error_budget}; e.g. 0.02")
    if args.report:  # before the model is loaded: a missing extra must not cost the whole run
        from clef_local.quality.plots import require_matplotlib

        require_matplotlib()
    from clef_local.airgap import airgap
    from clef_local.batch.ray_runner import RayPredictor, ray_settings
    from clef_local.data.jsonl import DataFormatError, read_jsonl
    from clef_local.errors import ClefError

    try:
        with airgap(not args.allow_network) as network:
            import clef_local

            examples = read_jsonl(args.data, limit=args.limit)
            if not examples:
                raise DataFormatError(f"{args.data}: no requests")
            ray = ray_settings(args)  # --ray: the predictions come from replicas, as in `clef-local batch --ray`
            model = (RayPredictor(model_path(args.model), ray, load_options=load_options(args),
                                  airgapped=not args.allow_network) if ray
                     else clef_local.load(model_path(args.model), **load_options(args)))
            bar = _progress_bar(len(examples), not args.no_progress)
            result, predictions = evaluate(model, examples, batch_size=args.batch_size, data_name=str(args.data),
                                           progress=lambda done, _total: bar.update(done - bar.n), intervals=settings)
            bar.close()
            if args.error_budget is not None:
                result.selective["budget"] = error_budget(selective_questions(result.rows), args.error_budget,
                                                          bound=args.budget_bound,
                                                          confidence_level=settings.confidence)
            result.meta["network"] = network
            result.meta["dtype"] = args.dtype
    except (ClefError, DataFormatError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"network: {network}")
    print(format_metrics(result))
    from clef_local.quality.report import markdown_table, selective_table_rows

    if result.selective:
        print()
        print(markdown_table(selective_table_rows(result)))
    if args.out:
        _write_predictions(args.out, examples, predictions)
    if args.json:
        args.json.write_text(json.dumps(result.to_json()) + "\n", encoding="utf-8")
    if args.report:
        from clef_local.quality.report import write_report

        write_report([], args.report, evals=[result], network=network)
        print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
