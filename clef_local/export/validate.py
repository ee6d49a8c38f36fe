"""Export validation (optimum's habit): the reference and the variant on a fixed probe set, loaded one after the
other (peak memory: the larger, not the sum), compared per question (KL, flips, max |Δp|) against the per-scheme
:data:`THRESHOLDS`. Never skipped silently: when it cannot run, :class:`ValidationUnavailable`; only
``--no-validate`` writes a variant without it, and records so. docs/quantization.md#validation.

Whether it can run is the loader's own plan (:func:`clef_local.backends.loader.plan_backend`), checked before
anything is written: each model resident when it fits, else streamed from disk (``offload="auto"``), else refused.
With a reference file (:mod:`clef_local.quality.reference_file`) the reference is not loaded at all.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clef_local.errors import ClefError, InsufficientMemoryError, one_line
from clef_local.quant import registry

if TYPE_CHECKING:
    from clef_local.formats.release import Release
    from clef_local.model import Prediction
    from clef_local.quality.reference_file import ReferenceFile

log = logging.getLogger(__name__)

VALIDATION = "validation.json"
METRICS = ("mean_kl", "max_kl", "flip_rate", "max_abs_dp")
# the packaged probe set's size: every type of question, enough for a 5% flip threshold to mean something, and a few
# minutes resident on a laptop (a reference streamed on a CPU takes hours: --validation-requests lowers it)
VALIDATION_REQUESTS = 64
# each scheme's limits, from its row (clef_local.quant.registry)
THRESHOLDS: dict[str, dict[str, float]] = {name: dict(row.validation) for name, row in registry.SCHEMES.items()}
_EPS = 1e-12


class ValidationFailed(ClefError):
    """The variant's decisions moved more than the scheme's thresholds allow (or the variant did not load)."""


class ValidationUnavailable(ClefError):
    """Validation cannot run here (no probe set, not enough memory, the reference does not load): the export is
    refused rather than written unvalidated; ``--no-validate`` is the explicit way to do that."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"validation cannot run: {reason}; the variant was not written (pass --no-validate to write "
                         f"it unvalidated: config.json and validation.json then say so)")


def compare(reference: Sequence[Sequence[np.ndarray]], variant: Sequence[Sequence[np.ndarray]]) -> dict[str, Any]:
    """Metrics of the variant's option probabilities against the reference's (one list per request)."""
    kls, flips, dps = [], [], []
    for ref_q, var_q in zip(reference, variant, strict=True):
        for p, q in zip(ref_q, var_q, strict=True):
            p64, q64 = np.asarray(p, np.float64), np.asarray(q, np.float64)
            kl = float(np.sum(p64 * (np.log(np.clip(p64, _EPS, None)) - np.log(np.clip(q64, _EPS, None)))))
            kls.append(max(kl, 0.0))
            flips.append(int(np.argmax(p64) != np.argmax(q64)))
            dps.append(float(np.max(np.abs(p64 - q64))))
    if not kls:
        raise ValueError("no questions to compare")
    return {"questions": len(kls), "mean_kl": float(np.mean(kls)), "max_kl": float(np.max(kls)),
            "flip_rate": float(np.mean(flips)), "flips": int(np.sum(flips)), "max_abs_dp": float(np.max(dps))}


@dataclass(frozen=True)
class ModelRun:
    """One model's pass over the probe set: its predictions, compute dtype, context, and how it ran (seconds,
    batches; bytes read, group loads and read seconds when streamed from disk), which validation.json records."""

    predictions: list[Prediction]
    dtype: str
    context: int
    summary: dict[str, Any]


def _predictions(path: Path | Release, requests: Sequence[dict[str, Any]], dtype: str | None, batch_size: int,
                 max_memory: str | None = None, truncate_state: bool = True, max_length: int | None = None,
                 role: str = "model") -> ModelRun:
    """``path``'s (a directory, or the release already read) predictions of ``requests`` (resident, or streamed
    from disk when it does not fit), its compute dtype and context (``max_length``; None: the model's default); a
    streamed run logs what it read per pass."""
    import clef_local

    started = time.perf_counter()
    model = clef_local.load(path, dtype=dtype, max_memory=max_memory, offload="auto", max_length=max_length)
    decision = model.backend.load_decision
    try:
        loaded = time.perf_counter() - started
        batches: list[float] = []
        predictions = model.predict(requests, truncate_state=truncate_state, batch_size=batch_size,
                                    batch_seconds=batches)
        summary: dict[str, Any] = {"load_seconds": round(loaded, 2), "batches": len(batches),
                                   "seconds": round(sum(batches), 2)}
        streamed = model.backend.describe().get("streamed")
        if streamed is not None:
            summary["streamed"] = streamed
            log.info("%s streamed from disk: %.2f GB read in %d pass%s, %.1f s per pass (%.1f s reading)", role,
                     streamed["bytes_read"] / 1e9, len(batches), "" if len(batches) == 1 else "es",
                     sum(batches) / max(len(batches), 1), streamed["read_seconds"])
        return ModelRun(predictions, decision.dtype if decision else str(dtype), model.max_length, summary)
    finally:
        del model
        gc.collect()


def _probabilities(run: ModelRun) -> list[list[np.ndarray]]:
    return [p.probabilities for p in run.predictions]


def _result(reference_dir: Path, variant_dir: Path, requests: Sequence[dict[str, Any]],
            ref: Sequence[Sequence[np.ndarray]], var: Sequence[Sequence[np.ndarray]],
            thresholds: Mapping[str, float], dtype: str | None, started: float) -> dict[str, Any]:
    metrics = compare(ref, var)
    checks = {}
    for name in METRICS:
        limit = thresholds.get(name)
        checks[name] = {"value": metrics[name], "threshold": limit,
                        "ok": limit is None or (math.isfinite(metrics[name]) and metrics[name] <= limit)}
    failed = [f"{name} {c['value']:.6g} > {c['threshold']:g}" for name, c in checks.items() if not c["ok"]]
    for name, c in checks.items():
        shown = "reported" if c["threshold"] is None else f"≤ {c['threshold']:g}"
        log.info("validation %s %-10s %.6g (%s)", "✓" if c["ok"] else "✗", name, c["value"], shown)
    return {"reference": str(reference_dir), "variant": str(variant_dir), "requests": len(requests),
            "questions": metrics["questions"], "flips": metrics["flips"], "dtype": dtype or "as stored",
            "metrics": {k: metrics[k] for k in METRICS}, "thresholds": dict(thresholds), "checks": checks,
            "passed": not failed, "failed": failed, "seconds": round(time.perf_counter() - started, 2)}


def validate_variant(reference_dir: str | Path, variant_dir: str | Path, requests: Sequence[dict[str, Any]],
                     thresholds: Mapping[str, float], *, dtype: str | None = None,
                     batch_size: int = 8) -> dict[str, Any]:
    """Run ``requests`` through the reference and then the variant (each loaded with ``clef_local.load``) and
    compare. ``thresholds`` maps metric names (:data:`METRICS`) to their maximum. Returns a dict with
    ``metrics``, ``thresholds``, ``checks`` ({metric: {value, threshold, ok}}), ``passed`` and ``failed`` (one
    "metric value > threshold" line per failing metric); exceptions of either load propagate."""
    started = time.perf_counter()
    ref = _probabilities(_predictions(Path(reference_dir), requests, dtype, batch_size, role="reference"))
    var = _probabilities(_predictions(Path(variant_dir), requests, dtype, batch_size, role="variant"))
    return _result(Path(reference_dir), Path(variant_dir), requests, ref, var, thresholds, dtype, started)


def validation_table(result: Mapping[str, Any]) -> Any:
    """A rich Table of the checks: metric, value, threshold, ✓/✗."""
    from rich.table import Table

    table = Table(title=f"validation: {result['requests']} requests, {result['questions']} questions",
                  caption=f"{result['flips']} flipped decisions")
    for column in ("metric", "value", "threshold", ""):
        table.add_column(column, justify="right" if column in ("value", "threshold") else "left")
    for name, c in result["checks"].items():
        mark = "[green]✓[/green]" if c["ok"] else "[red]✗[/red]"
        table.add_row(name, f"{c['value']:.6g}", "—" if c["threshold"] is None else f"{c['threshold']:g}", mark)
    return table


def validation_requests(n: int = VALIDATION_REQUESTS, seed: int = 0, *, data: str | Path | None = None,
                        vision: bool = False) -> list[dict[str, Any]]:
    """The requests export validation runs on: ``n`` from the datasets shipped in the package (image requests among
    them when ``vision``), or the first ``n`` of the JSONL file ``data``
    (:func:`clef_local.export.probe_set.validation_set`)."""
    from clef_local.export.probe_set import validation_set

    return validation_set(n, seed, data=data, vision=vision)


@dataclass(frozen=True)
class ValidationInputs:
    """What :func:`check_validation` found: the probe set, and the reference file's probabilities when one is used
    (None: the reference runs here)."""

    requests: list[dict[str, Any]]
    release: Release  # the reference release, read once
    reference: ReferenceFile | None = None


def check_validation(reference_dir: Path | Release, n: int = VALIDATION_REQUESTS, seed: int = 0, *,
                     scheme: str | None = None,
                     dtype: str | None = None, max_memory: str | None = None,
                     reference_file: str | Path | None = None, max_length: int | None = None,
                     data: str | Path | None = None) -> ValidationInputs:
    """Check, before an export writes anything, that its validation can run: the probe set reads (``data``: the
    user's JSONL requests instead, each checked; a release with a vision tower gets image probes too); the reference
    fits as the loader plans it (resident, else streamed from disk; logged), or ``reference_file`` holds its
    probabilities on this probe set; and the ``scheme`` variant will fit too (planned from the source's headers),
    both at ``max_length`` tokens (None: the model's default). :class:`ValidationUnavailable` naming why not.
    ``reference_dir``: the reference's directory, or its :class:`Release` already read (not read again)."""
    from clef_local.backends.loader import plan_backend
    from clef_local.formats.release import Release, read_release
    from clef_local.planning.load_options import LoadOptions

    release = reference_dir if isinstance(reference_dir, Release) else read_release(reference_dir)
    requests = validation_requests(n, seed, data=data, vision=release.has_vision)
    reference_dir = release.path
    stored = None
    if reference_file is not None:
        from clef_local.quality import reference_file as files

        stored = files.read(reference_file)
        files.check_requests(stored, requests, f"--validation-data {data} ({len(requests)} requests)" if data else
                             f"the packaged probe set ({n} requests, seed {seed})")
        files.check_reference(stored, reference_dir)
        files.check_run(stored, dtype=dtype or stored.dtype, context=None)
        log.info("reference from %s: %s", reference_file, stored.describe())
    else:
        try:
            decision = plan_backend(release, LoadOptions(dtype=dtype, max_memory=max_memory, offload="auto",
                                                         max_length=max_length))
        except InsufficientMemoryError as exc:
            raise ValidationUnavailable(
                f"the reference does not fit here, not even streamed from disk ({one_line(exc)}); or compare with "
                f"its probabilities computed elsewhere: clef-local drift --reference {reference_dir} "
                f"--save-reference FILE there, then --reference-file FILE here") from exc
        if decision.stream is not None:
            log.info("reference streamed from disk: %s", decision.stream.summary())
    if scheme is not None:
        try:
            decision = plan_backend(release, LoadOptions(dtype=dtype or (stored.dtype if stored else None),
                                                         max_memory=max_memory, offload="auto", max_length=max_length),
                                    fmt=scheme)
        except InsufficientMemoryError as exc:
            raise ValidationUnavailable(f"the {scheme} variant will not fit here, not even streamed from disk "
                                        f"({one_line(exc)})") from exc
        if decision.stream is not None:
            log.info("%s variant streamed from disk: %s", scheme, decision.stream.summary())
    return ValidationInputs(requests, release, stored)


def validate_export(reference_dir: Path | Release, variant_dir: Path, scheme: str, n: int = VALIDATION_REQUESTS,
                    seed: int = 0,
                    dtype: str | None = None, variant_name: str | Path | None = None, *,
                    thresholds: Mapping[str, float] | None = None, max_memory: str | None = None,
                    reference_file: str | Path | None = None, max_length: int | None = None,
                    checked: ValidationInputs | None = None, data: str | Path | None = None) -> dict[str, Any]:
    """Validation as the export runs it: packaged probe set, scheme thresholds, ``validation.json`` in the variant;
    :class:`ValidationUnavailable` when it cannot run (:func:`check_validation`, or the reference does not load or
    run); :class:`ValidationFailed` naming each failing metric and its value when a threshold is exceeded or the
    variant does not load. ``variant_name`` is recorded instead of ``variant_dir`` (the export validates its
    temporary directory). ``thresholds`` replaces the scheme's :data:`THRESHOLDS` (a mixed variant's budget).
    ``max_memory`` caps both loads (each streamed from disk when it does not fit); ``reference_file``: the
    reference's probabilities from ``drift --save-reference`` instead of running it. ``max_length``: the context both
    models are loaded at (None: the model's default). ``reference_dir`` may be the :class:`Release` already read:
    it is passed on as it is (read once). ``checked``: what :func:`check_validation` found for these same
    arguments before the export began (not checked again). ``data``: validate on the first ``n`` requests of this
    JSONL file instead of the packaged probe set (``--validation-data``)."""
    started = time.perf_counter()
    limits = thresholds if thresholds is not None else THRESHOLDS[scheme]
    inputs = checked or check_validation(reference_dir, n, seed, dtype=dtype, max_memory=max_memory,
                                         reference_file=reference_file, max_length=max_length, data=data)
    requests, stored, release = inputs.requests, inputs.reference, inputs.release
    runs: dict[str, dict[str, Any]] = {}
    if stored is None:
        try:
            reference = _predictions(release, requests, dtype, 8, max_memory, max_length=max_length,
                                     role="reference")
        except (Exception, MemoryError) as exc:
            raise ValidationUnavailable(f"the reference could not be loaded or run ({type(exc).__name__}: "
                                        f"{' '.join(str(exc).split())})") from exc
        runs["reference"] = reference.summary
    try:
        if stored is None:
            variant = _predictions(variant_dir, requests, dtype, 8, max_memory, max_length=max_length,
                                   role="variant")
        else:
            variant = _predictions(variant_dir, requests, dtype or stored.dtype, 8, max_memory,
                                   truncate_state=stored.truncate_state, max_length=max_length, role="variant")
    except Exception as exc:
        raise ValidationFailed(f"the variant could not be loaded or run for validation ({type(exc).__name__}: "
                               f"{' '.join(str(exc).split())}); pass --no-validate to export without validating"
                               ) from exc
    runs["variant"] = variant.summary
    var = _probabilities(variant)
    if stored is None:
        ref = _probabilities(reference)
    else:
        from clef_local.quality import reference_file as files

        files.check_run(stored, dtype=variant.dtype, context=variant.context)
        ref = [p.probabilities for p in files.predictions_for(stored, variant.predictions)]
    result = _result(release.path, Path(variant_name or variant_dir), requests, ref, var, limits,
                     dtype or (stored.dtype if stored else None), started)
    result["runs"] = runs
    if stored is not None:
        result["reference_file"] = str(reference_file)
    result = {"validated": not result["failed"], **result}
    (variant_dir / VALIDATION).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if result["failed"]:
        raise ValidationFailed(f"{scheme} variant fails validation: " + ", ".join(result["failed"]))
    return result
