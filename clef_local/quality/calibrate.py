"""``clef-local calibrate``: one softmax temperature per question type, fitted and stored in the variant.

On labels (the gold answers' NLL) or with ``--match REFERENCE`` (the mean KL to the reference, no labels); the
temperatures go into ``config.json`` (docs/format.md §5) and its manifest entry is rewritten, so the load-time check
still passes. ``--error-budget RATE`` also stores, beside them, the confidence threshold per type that keeps the error
within RATE on the ``--measure`` data (after the temperatures: :mod:`clef_local.quality.selective`), which ``batch``
then marks rows against. docs/quality.md#calibrate.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clef_local.formats.release import write_json
from clef_local.options import add_network_flag, add_runtime_flags, load_options
from clef_local.quality.intervals import DEFAULT_CONFIDENCE
from clef_local.quality.metrics import labelled_report
from clef_local.quality.results import gold_index
from clef_local.quality.selective import BOUNDS, error_budget
from clef_local.runtime.schema import QUESTION_TYPES

if TYPE_CHECKING:
    from clef_local.data.datasets import Example
    from clef_local.model import ClefModel, Prediction

log = logging.getLogger(__name__)

T_BOUNDS = (0.05, 20.0)
_TINY = 1e-30


def _log_probs(p: np.ndarray) -> np.ndarray:
    # log p differs from the logits by a constant per question, so softmax(log p / T) = softmax(logits / T)
    return np.log(np.clip(np.asarray(p, dtype=np.float64), _TINY, None))


def scale(p: np.ndarray, temperature: float) -> np.ndarray:
    """The distribution ``p`` re-tempered: softmax(log p / T)."""
    z = _log_probs(p) / temperature
    z -= z.max()
    e = np.exp(z)
    return e / e.sum()


def _minimize(objective: Any) -> float:
    from scipy.optimize import minimize_scalar

    lo, hi = np.log(T_BOUNDS[0]), np.log(T_BOUNDS[1])
    # coarse grid first: the objectives are smooth in log T but a bounded Brent search alone can stop at an edge
    grid = np.linspace(lo, hi, 41)
    best = grid[int(np.argmin([objective(np.exp(g)) for g in grid]))]
    step = grid[1] - grid[0]
    found = minimize_scalar(lambda g: objective(np.exp(g)), bounds=(max(lo, best - step), min(hi, best + step)),
                            method="bounded", options={"xatol": 1e-4})
    return float(np.exp(found.x))


def fit_temperature_nll(probs: Sequence[np.ndarray], gold: Sequence[int]) -> float:
    """The T that minimizes the mean NLL of the gold options under softmax(log p / T)."""
    logs = [_log_probs(p) for p in probs]

    def nll(t: float) -> float:
        total = 0.0
        for z, g in zip(logs, gold, strict=True):
            s = z / t
            total += float(np.logaddexp.reduce(s) - s[g])
        return total / max(len(logs), 1)

    return _minimize(nll)


def fit_temperature_match(reference: Sequence[np.ndarray], candidate: Sequence[np.ndarray]) -> float:
    """The T that minimizes the mean KL(reference ‖ softmax(log p_cand / T))."""
    refs = [np.asarray(p, dtype=np.float64) for p in reference]
    logs = [_log_probs(p) for p in candidate]

    def kl(t: float) -> float:
        total = 0.0
        for p, z in zip(refs, logs, strict=True):
            s = z / t
            log_q = s - np.logaddexp.reduce(s)
            mask = p > 0
            total += float(np.sum(p[mask] * (np.log(p[mask]) - log_q[mask])))
        return total / max(len(refs), 1)

    return _minimize(kl)


@dataclass
class CalibrationResult:
    """Fitted temperatures per type with the labelled metrics before/after on the measurement set."""

    model: str
    objective: str  # "labels" or "match:<reference>"
    fitted_on: str
    measured_on: str
    temperatures: dict[str, float]
    types: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind → {temperature, n_fit, before, after}
    thresholds: dict[str, Any] = field(default_factory=dict)  # --error-budget: selective.error_budget's result

    def to_json(self) -> dict[str, Any]:
        return {"format": "clef-local-calibration/1", "model": self.model, "objective": self.objective,
                "fitted_on": self.fitted_on, "measured_on": self.measured_on, "temperatures": self.temperatures,
                "types": self.types, "thresholds": self.thresholds}


def _questions(examples: Sequence[Example], predictions: Sequence[Prediction],
               need_labels: bool) -> list[tuple[str, np.ndarray, int | None, list[str]]]:
    out: list[tuple[str, np.ndarray, int | None, list[str]]] = []
    for example, pred in zip(examples, predictions, strict=True):
        for question, p in zip(pred.encoded.questions, pred.probabilities, strict=True):
            label = example.labels.get(question.question_id)
            if label is None and need_labels:
                continue
            k = len(question.option_ids)
            gold = None if label is None else gold_index(question.option_ids, label)
            out.append((QUESTION_TYPES[question.question_type], np.asarray(p[:k], dtype=np.float64), gold,
                        list(question.option_ids)))
    return out


def raw_predictions(model: ClefModel, examples: Sequence[Example], batch_size: int = 8) -> list[Prediction]:
    """Predictions at temperature 1 (any stored calibration switched off for the run)."""
    saved, model.temperatures = model.temperatures, {}
    try:
        return model.predict([e.request for e in examples], batch_size=batch_size)
    finally:
        model.temperatures = saved


def fit(candidate: Sequence[Prediction], examples: Sequence[Example], *,
        reference: Sequence[Prediction] | None = None) -> dict[str, float]:
    """One temperature per question type present: on labels (NLL), or matching ``reference`` (KL)."""
    temps: dict[str, float] = {}
    if reference is None:
        rows = _questions(examples, candidate, need_labels=True)
        if not rows:
            raise ValueError("no labelled questions to fit on; pass data with \"labels\" or use --match REFERENCE")
        for kind in QUESTION_TYPES:
            chosen = [(p, g) for k, p, g, _ in rows if k == kind and g is not None]
            if chosen:
                temps[kind] = fit_temperature_nll([p for p, _ in chosen], [g for _, g in chosen])
        return temps
    ref_rows = _questions(examples, reference, need_labels=False)
    cand_rows = _questions(examples, candidate, need_labels=False)
    for kind in QUESTION_TYPES:
        pairs = [(r[1], c[1]) for r, c in zip(ref_rows, cand_rows, strict=True) if r[0] == kind]
        if pairs:
            temps[kind] = fit_temperature_match([r for r, _ in pairs], [c for _, c in pairs])
    return temps


def before_after(predictions: Sequence[Prediction], examples: Sequence[Example],
                 temps: Mapping[str, float]) -> dict[str, dict[str, Any]]:
    """Labelled metrics per type at T = 1 and at the fitted T (from the same T = 1 predictions)."""
    rows = _questions(examples, predictions, need_labels=True)
    out: dict[str, dict[str, Any]] = {}
    for kind in QUESTION_TYPES:
        chosen = [(p, g, o) for k, p, g, o in rows if k == kind and g is not None]
        t = temps.get(kind, 1.0)
        entry: dict[str, Any] = {"temperature": t, "fitted": kind in temps}
        if chosen:
            gold = [int(g) for _, g, _ in chosen]
            options = [o for _, _, o in chosen]
            entry["before"] = labelled_report([p for p, _, _ in chosen], gold, options)
            entry["after"] = labelled_report([scale(p, t) for p, _, _ in chosen], gold, options)
        if kind in temps or chosen:
            out[kind] = entry
    return out


def budget_thresholds(predictions: Sequence[Prediction], examples: Sequence[Example], temps: Mapping[str, float],
                      budget: float, *, bound: str = "upper", confidence: float = DEFAULT_CONFIDENCE
                      ) -> dict[str, Any]:
    """:func:`clef_local.quality.selective.error_budget` on the labelled questions of ``examples``, from their
    T = 1 ``predictions`` re-tempered by ``temps`` (the probabilities the calibrated model will give)."""
    rows = _questions(examples, predictions, need_labels=True)
    questions = []
    for kind, p, gold, _ in rows:
        q = scale(p, temps.get(kind, 1.0))
        questions.append((kind, float(q.max()), int(np.argmax(q)) == gold))
    if not questions:
        raise ValueError("--error-budget needs labelled questions in the --measure data (or --data)")
    return error_budget(questions, budget, bound=bound, confidence_level=confidence)


def stored_thresholds(result: Mapping[str, Any], chosen_on: str) -> dict[str, dict[str, Any]]:
    """The ``thresholds`` member of config.json's calibration entry from :func:`budget_thresholds`' result."""
    return {kind: {"threshold": None if t["threshold"] is None else round(float(t["threshold"]), 6),
                   "budget": result["budget"], "bound": result["bound"], "confidence": result["confidence"],
                   "coverage": round(float(t["coverage"]), 6), "n": t["n"], "chosen_on": chosen_on}
            for kind, t in result["types"].items()}


def store_temperatures(variant: str | Path, temps: Mapping[str, float], *, fitted_on: str, objective: str,
                       out_config: str | Path | None = None,
                       thresholds: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
    """Write the temperatures (and ``thresholds``: :func:`stored_thresholds`) into ``config.json`` (or
    ``out_config``) and refresh the manifest entry."""
    from clef_local.formats.manifest import MANIFEST, read_manifest, sha256
    from clef_local.model import CALIBRATION_KEY

    variant = Path(variant)
    config_path = variant / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config[CALIBRATION_KEY] = {"temperatures": {k: round(float(v), 6) for k, v in temps.items()},
                               "fitted_on": fitted_on, "objective": objective,
                               **({"thresholds": {k: dict(v) for k, v in thresholds.items()}} if thresholds else {})}
    target = Path(out_config) if out_config else config_path
    write_json(target, config)
    manifest = read_manifest(variant)
    if out_config is None and manifest is not None and "config.json" in manifest["files"]:
        # the load-time check compares sizes with the manifest: without this the variant would no longer load
        manifest["files"]["config.json"] = {"size": config_path.stat().st_size, "sha256": sha256(config_path)}
        manifest["calibration"] = config[CALIBRATION_KEY]
        write_json(variant / MANIFEST, manifest)
    return target


def main(argv: list[str] | None = None) -> int:
    """Fit and store per-type temperatures; print ECE before/after."""
    parser = argparse.ArgumentParser(prog="clef-local calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the variant to calibrate (its config.json is updated)")
    parser.add_argument("--data", type=Path, required=True, help="JSONL to fit on (labelled unless --match)")
    parser.add_argument("--match", help="fit to this reference's distributions (KL) instead of the labels")
    parser.add_argument("--measure", type=Path, nargs="+", help="held-out labelled JSONL for ECE before/after "
                        "(default: the fit data)")
    parser.add_argument("--limit", type=int, help="first N requests of each file")
    parser.add_argument("--batch-size", type=int, default=8)
    add_runtime_flags(parser, max_memory=True, offload="auto")  # the variant and --match's reference alike
    parser.add_argument("--out-config", type=Path, help="write the updated config.json here, leaving the model as is")
    parser.add_argument("--error-budget", type=float, metavar="RATE",
                        help="also store the confidence threshold per type that keeps the error at or under RATE on "
                             "the --measure data (batch marks answers under it)")
    parser.add_argument("--budget-bound", choices=BOUNDS, default="upper",
                        help="choose the thresholds on the error's exact upper bound (default) or the observed error")
    parser.add_argument("--confidence", type=float, default=DEFAULT_CONFIDENCE,
                        help=f"the upper bound's level (default {DEFAULT_CONFIDENCE})")
    parser.add_argument("--dry-run", action="store_true", help="fit and measure, store nothing")
    parser.add_argument("--report", type=Path, help="HTML report with ECE before/after")
    parser.add_argument("--json", type=Path, help="the result as JSON")
    add_network_flag(parser)
    args = parser.parse_args(argv)
    if args.error_budget is not None and not 0 < args.error_budget < 1:
        parser.error(f"--error-budget must be a rate in (0, 1), got {args.error_budget}; e.g. 0.02")
    if not 0.5 <= args.confidence < 1:
        parser.error(f"--confidence must be in [0.5, 1), got {args.confidence}")
    if args.report:  # before a model is loaded: a missing extra must not cost the whole run
        from clef_local.quality.plots import require_matplotlib

        require_matplotlib()
    from clef_local.airgap import airgap
    from clef_local.data.jsonl import DataFormatError, read_jsonl
    from clef_local.errors import ClefError

    options = load_options(args)
    try:
        with airgap(not args.allow_network) as network:
            import clef_local

            examples = read_jsonl(args.data, limit=args.limit)
            reference = None
            if args.match:
                ref_model = clef_local.load(args.match, **options)
                if (decision := ref_model.backend.load_decision) is not None and decision.stream is not None:
                    log.info("reference streamed from disk: %s", decision.stream.summary())
                reference = raw_predictions(ref_model, examples, args.batch_size)
                del ref_model
            model = clef_local.load(args.model, **options)
            temps = fit(raw_predictions(model, examples, args.batch_size), examples, reference=reference)
            measure_files = args.measure or [args.data]
            measured = [e for path in measure_files for e in read_jsonl(path, limit=args.limit)]
            measured_predictions = raw_predictions(model, measured, args.batch_size)
            types = before_after(measured_predictions, measured, temps)
            budget = None
            if args.error_budget is not None:
                budget = budget_thresholds(measured_predictions, measured, temps, args.error_budget,
                                           bound=args.budget_bound, confidence=args.confidence)
    except (ClefError, DataFormatError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    objective = f"match:{args.match}" if args.match else "labels"
    measured_on = ", ".join(str(p) for p in measure_files)
    result = CalibrationResult(str(args.model), objective, str(args.data), measured_on, temps, types, budget or {})
    print(f"network: {network}")
    for kind, entry in types.items():
        before, after = entry.get("before"), entry.get("after")
        change = f"ECE {before['ece']:.4f} → {after['ece']:.4f}, NLL {before['nll']:.4f} → {after['nll']:.4f} " \
                 f"(n={before['n']})" if before and after else "no labelled questions to measure"
        note = "" if entry["fitted"] else " (not fitted: no such questions in the fit data)"
        if entry["fitted"] and not T_BOUNDS[0] * 1.01 < entry["temperature"] < T_BOUNDS[1] * 0.99:
            note = f" (at the search bound {T_BOUNDS}: the fit wants an extreme temperature)"
        print(f"{kind:<7} T={entry['temperature']:.3f}  {change}{note}")
    for kind, t in (budget or {}).get("types", {}).items():
        shown = "none (answer nothing)" if t["threshold"] is None else f"{t['threshold']:.4f}"
        print(f"{kind:<7} threshold {shown} for error ≤ {args.error_budget:g} ({args.budget_bound} bound): coverage "
              f"{t['coverage']:.1%} of {t['n']}, observed error "
              f"{'—' if t['error'] is None else format(t['error'], '.2%')}")
    if not args.dry_run:
        target = store_temperatures(args.model, temps, fitted_on=str(args.data), objective=objective,
                                    out_config=args.out_config,
                                    thresholds=stored_thresholds(budget, measured_on) if budget else None)
        print(f"stored in {target}")
    if args.json:
        args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
    if args.report:
        from clef_local.quality.report import write_report

        write_report([], args.report, calibration=[result.to_json()], network=network)
        print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
