"""Export validation (optimum's habit): the reference and the variant on a fixed probe set, loaded one after the
other (peak memory: the larger, not the sum), compared per question (KL, flips, max |Δp|) against the per-scheme
:data:`THRESHOLDS`. Never skipped silently: when it cannot run, :class:`ValidationUnavailable`; only
``--no-validate`` writes a variant without it, and records so. docs/quantization.md#validation.

Whether it can run is the loader's own plan (:func:`clef_local.backends.loader.plan_backend`), checked before
anything is written: each model resident when it fits, else streamed from disk (``offload="auto"``), else refused.
With a reference file (:mod:`clef_local.quality.reference_file`) the reference is not loaded at all.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clef_local.errors import InsufficientMemoryError, one_line
from clef_local.export.validation_errors import ValidationFailed as ValidationFailed
from clef_local.export.validation_errors import ValidationRefused as ValidationRefused
from clef_local.export.validation_errors import ValidationUnavailable as ValidationUnavailable
from clef_local.export.validation_errors import ValidationUndecided as ValidationUndecided
from clef_local.quant import registry

if TYPE_CHECKING:
    from clef_local.export.reference_cache import ReferenceCache
    from clef_local.export.turns import Turns
    from clef_local.formats.release import Release
    from clef_local.planning.choice import LoadDecision
    from clef_local.quality.reference_file import ReferenceFile

log = logging.getLogger(__name__)

VALIDATION = "validation.json"
METRICS = ("mean_kl", "max_kl", "flip_rate", "max_abs_dp")
# the most probes a sequential validation may use unless its scheme says (clef_local.quant.registry
# ``validation_requests``): what a 5% flip limit needs (benchmarks/verdict_simulation.py); it stops when decided
VALIDATION_REQUESTS = 256
# each scheme's limits, from its row (clef_local.quant.registry)
THRESHOLDS: dict[str, dict[str, float]] = {name: dict(row.validation) for name, row in registry.SCHEMES.items()}
_EPS = 1e-12


@dataclass(frozen=True)
class Differences:
    """Per question, the variant against the reference: KL(ref ‖ var), whether the argmax moved, max |Δp|, and the
    index of the question's request (questions of one request share a forward pass)."""

    kl: np.ndarray
    flipped: np.ndarray
    max_dp: np.ndarray
    request_of: np.ndarray

    @classmethod
    def of(cls, reference: Sequence[Sequence[np.ndarray]], variant: Sequence[Sequence[np.ndarray]],
           first_request: int = 0) -> Differences:
        kls, flips, dps, owners = [], [], [], []
        for r, (ref_q, var_q) in enumerate(zip(reference, variant, strict=True), start=first_request):
            for p, q in zip(ref_q, var_q, strict=True):
                p64, q64 = np.asarray(p, np.float64), np.asarray(q, np.float64)
                kl = float(np.sum(p64 * (np.log(np.clip(p64, _EPS, None)) - np.log(np.clip(q64, _EPS, None)))))
                kls.append(max(kl, 0.0))
                flips.append(bool(np.argmax(p64) != np.argmax(q64)))
                dps.append(float(np.max(np.abs(p64 - q64))))
                owners.append(r)
        return cls(np.asarray(kls, np.float64), np.asarray(flips, bool), np.asarray(dps, np.float64),
                   np.asarray(owners, np.int64))

    def __add__(self, other: Differences) -> Differences:
        return Differences(*(np.concatenate([a, b]) for a, b in
                             zip((self.kl, self.flipped, self.max_dp, self.request_of),
                                 (other.kl, other.flipped, other.max_dp, other.request_of), strict=True)))

    def metrics(self) -> dict[str, Any]:
        """The point figures: questions, mean and max KL, flip rate and count, max |Δp|."""
        if not self.kl.size:
            raise ValueError("no questions to compare")
        return {"questions": int(self.kl.size), "mean_kl": float(self.kl.mean()), "max_kl": float(self.kl.max()),
                "flip_rate": float(self.flipped.mean()), "flips": int(self.flipped.sum()),
                "max_abs_dp": float(self.max_dp.max())}


def compare(reference: Sequence[Sequence[np.ndarray]], variant: Sequence[Sequence[np.ndarray]]) -> dict[str, Any]:
    """Metrics of the variant's option probabilities against the reference's (one list per request)."""
    return Differences.of(reference, variant).metrics()


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
    from clef_local.export.turns import Turns

    started = time.perf_counter()
    turns = Turns(batch_size=batch_size)
    try:
        ref = turns.predict("reference", Path(reference_dir), requests, dtype=dtype).predictions
        var = turns.predict("variant", Path(variant_dir), requests, dtype=dtype).predictions
    finally:
        turns.close()
    return _result(Path(reference_dir), Path(variant_dir), requests, [p.probabilities for p in ref],
                   [p.probabilities for p in var], thresholds, dtype, started)


def validation_table(result: Mapping[str, Any]) -> Any:
    """A rich Table of the checks: metric, value, its bounds at the last look (sequential validations), limit,
    ✓ (inside) / ✗ (outside) / ? (open); the caption says the verdict and what it used."""
    from rich.table import Table

    verdict = result.get("verdict", "pass" if result.get("passed") else "fail")
    probes = f" of {result['probe_set']}" if "probe_set" in result else ""
    table = Table(title=f"validation: {verdict} after {result['requests']}{probes} requests, "
                        f"{result['questions']} questions",
                  caption=f"{result['flips']} flipped decisions" + _level_caption(result))
    for column in ("metric", "value", "bounds", "limit", ""):
        table.add_column(column, justify="left" if column in ("metric", "") else "right")
    for name, c in result["checks"].items():
        state = c.get("state", "inside" if c["ok"] else "outside")
        mark = {"inside": "[green]✓[/green]", "outside": "[red]✗[/red]"}.get(state, "[yellow]?[/yellow]")
        bounds = f"[{c['lower']:.4g}, {c['upper']:.4g}]" if "upper" in c else "—"
        table.add_row(name, f"{c['value']:.4g}", bounds, "—" if c["threshold"] is None else f"≤ {c['threshold']:g}",
                      mark if c["threshold"] is not None else "")
    return table


def _level_caption(result: Mapping[str, Any]) -> str:
    sequential = result.get("sequential")
    if not sequential or not sequential.get("looks"):
        return ""
    last = sequential["looks"][-1]
    return (f"; look {len(sequential['looks'])} of {len(sequential['schedule'])}, upper bounds at level "
            f"{last['level']:.2g}; overall error ≤ {sequential['alpha']:g} each way")


def validation_requests(n: int = VALIDATION_REQUESTS, seed: int = 0, *, data: str | Path | None = None,
                        vision: bool = False) -> list[dict[str, Any]]:
    """The requests export validation runs on: ``n`` from the datasets shipped in the package (image requests among
    them when ``vision``), or the first ``n`` of the JSONL file ``data``
    (:func:`clef_local.export.probe_set.validation_set`)."""
    from clef_local.export.probe_set import validation_set

    return validation_set(n, seed, data=data, vision=vision)


@dataclass(frozen=True)
class ValidationInputs:
    """What :func:`check_validation` found: the probe set, the reference release, the reference file's
    probabilities when one is used (None: the reference runs here, or its answers come from the user cache), and
    the dtype and context the reference is planned to run at (the user cache's keys)."""

    requests: list[dict[str, Any]]
    release: Release  # the reference release, read once
    reference: ReferenceFile | None = None
    dtype: str | None = None
    context: int | None = None  # the tokens a state is truncated to: the answers depend on it (the cache's key)
    load_context: int | None = None  # the tokens both models load at: what the longest probe needs
    left_out: int = 0  # probes asked for that did not fit this machine (validation_context)


def _plan_reference(release: Release, context: int, *, dtype: str | None, max_memory: str | None) -> LoadDecision:
    from clef_local.backends.loader import plan_backend
    from clef_local.planning.load_options import LoadOptions

    try:
        return plan_backend(release, LoadOptions(dtype=dtype, max_memory=max_memory, offload="auto",
                                                 max_length=context))
    except InsufficientMemoryError as exc:
        raise _does_not_fit(exc, release.path) from exc


def _does_not_fit(exc: InsufficientMemoryError, reference_dir: Path) -> ValidationUnavailable:
    return ValidationUnavailable(
        f"the reference does not fit here, not even streamed from disk ({one_line(exc)}); or compare with its "
        f"probabilities computed elsewhere: clef-local drift --reference {reference_dir} --save-reference FILE "
        "there, then --reference-file FILE here")


def check_validation(reference_dir: Path | Release, n: int = VALIDATION_REQUESTS, seed: int = 0, *,
                     scheme: str | None = None,
                     dtype: str | None = None, max_memory: str | None = None,
                     reference_file: str | Path | None = None, max_length: int | None = None,
                     data: str | Path | None = None, limits: Mapping[str, float] | None = None) -> ValidationInputs:
    """Check, before an export writes anything, that its validation can run: the probe set reads (``data``: the
    user's JSONL requests instead, each checked; a release with a vision tower gets image probes too); the reference
    fits as the loader plans it (resident, else streamed from disk; logged), or ``reference_file`` holds its
    probabilities on (a prefix of) this probe set; and the ``scheme`` variant will fit too (planned from the
    source's headers), both at ``max_length`` tokens (None: the model's default). :class:`ValidationUnavailable`
    naming why not, as when the probes are too few for any outcome to pass ``limits`` (None: the ``scheme``'s).
    ``reference_dir``: the reference's directory, or its :class:`Release` already read."""
    from clef_local.backends.loader import plan_backend
    from clef_local.export.validation_context import fit_probes
    from clef_local.formats.release import Release, read_release
    from clef_local.planning.load_options import LoadOptions

    release = reference_dir if isinstance(reference_dir, Release) else read_release(reference_dir)
    requests = validation_requests(n, seed, data=data, vision=release.has_vision)
    reference_dir = release.path
    stored, planned, left_out = None, None, 0
    if reference_file is not None:
        from clef_local.quality import reference_file as files

        stored = files.read(reference_file)
        if len(stored.records) < len(requests):  # the sequential verdict may use a prefix; more it cannot use
            requests = requests[:len(stored.records)]
        files.check_requests(stored, requests, f"--validation-data {data} ({len(requests)} requests)" if data else
                             f"the packaged probe set ({len(requests)} requests, seed {seed})")
        files.check_reference(stored, reference_dir)
        files.check_run(stored, dtype=dtype or stored.dtype, context=None)
        log.info("reference from %s: %s", reference_file, stored.describe())
    if max_length is not None:  # asked for: both models load at it (a longer state is truncated, as ever)
        context = truncation = max_length
        if stored is None:
            planned = _plan_reference(release, max_length, dtype=dtype, max_memory=max_memory)
    else:  # as long as the longest probe needs (validation_context), cut when even that does not fit
        try:
            fit = fit_probes(release, requests, dtype=dtype, max_memory=max_memory, plan_reference=stored is None)
        except InsufficientMemoryError as exc:
            raise _does_not_fit(exc, reference_dir) from exc
        requests, context, truncation = fit.requests, fit.context, fit.truncation
        planned, left_out = fit.decision, fit.left_out
    if planned is not None and planned.stream is not None:
        log.info("reference streamed from disk: %s", planned.stream.summary())
    gated = limits if limits is not None else THRESHOLDS[scheme] if scheme is not None else None
    if gated is not None:
        from clef_local.quality import sequential

        questions = sum(len(r.get("questions") or {}) for r in requests)
        if reason := sequential.can_pass(sequential.schedule(len(requests)), questions, gated):
            more = "more lines in --validation-data" if data else "--validation-requests N with a larger N"
            if left_out:
                more = f"a higher --max-memory: {left_out} probes did not fit"
            raise ValidationUnavailable(f"{reason} ({more}, or --no-validate)")
    if scheme is not None:
        try:
            decision = plan_backend(release, LoadOptions(dtype=dtype or (stored.dtype if stored else None),
                                                         max_memory=max_memory, offload="auto", max_length=context),
                                    fmt=scheme)
        except InsufficientMemoryError as exc:
            raise ValidationUnavailable(f"the {scheme} variant will not fit here, not even streamed from disk "
                                        f"({one_line(exc)})") from exc
        if decision.stream is not None:
            log.info("%s variant streamed from disk: %s", scheme, decision.stream.summary())
    return ValidationInputs(requests, release, stored, planned.dtype if planned else None, truncation, context,
                            left_out)


def validate_export(reference_dir: Path | Release, variant_dir: Path, scheme: str, n: int = VALIDATION_REQUESTS,
                    seed: int = 0,
                    dtype: str | None = None, variant_name: str | Path | None = None, *,
                    thresholds: Mapping[str, float] | None = None, max_memory: str | None = None,
                    reference_file: str | Path | None = None, max_length: int | None = None,
                    checked: ValidationInputs | None = None, cache: bool = True,
                    data: str | Path | None = None, label: str | None = None) -> dict[str, Any]:
    """Validation as the export runs it, sequentially (docs/quantization.md#the-verdict-sequentially): the probe set
    in growing batches (:func:`clef_local.quality.sequential.schedule`), the bounds of each gated figure looked at
    after each batch against the scheme's limits, until they decide or the probe set is used up.

    Writes ``validation.json`` into ``variant_dir`` and returns it when the variant passes; raises
    :class:`ValidationFailed` (a lower bound outside a limit, or the variant does not load) or
    :class:`ValidationUndecided` (the probe set used up), each carrying the record it wrote, and
    :class:`ValidationUnavailable` when validation cannot run (:func:`check_validation`, or the reference does not
    load or run). ``variant_name`` is recorded instead of ``variant_dir`` (the export validates its temporary
    directory); ``thresholds`` replaces the scheme's :data:`THRESHOLDS` (a mixed variant's budget); ``max_memory``
    caps each load (streamed from disk when it does not fit); ``reference_file``: the reference's probabilities
    computed elsewhere instead of running it; ``max_length``: the context both models load at (None: the model's
    default); ``checked``: what :func:`check_validation` found before the export began; ``data``: the user's JSONL
    requests instead of the packaged probe set; ``label``: what the one-line errors call the variant (default
    "``scheme`` variant"). ``cache``: the reference's
    answers are read from and added to the user cache (:mod:`clef_local.export.reference_cache`), so the next
    variant of the same release does not run the reference again."""
    from clef_local.export.turns import Turns
    from clef_local.quality import sequential

    started = time.perf_counter()
    limits = thresholds if thresholds is not None else THRESHOLDS[scheme]
    inputs = checked or check_validation(reference_dir, n, seed, dtype=dtype, max_memory=max_memory,
                                         reference_file=reference_file, max_length=max_length, data=data)
    requests, release = inputs.requests, inputs.release
    answers = _ReferenceAnswers.of(inputs, dtype=dtype, cache=cache)
    plan = sequential.schedule(len(requests))
    turns = Turns(max_memory=max_memory, max_length=inputs.load_context or max_length)
    differences: Differences | None = None
    looks: list[sequential.Look] = []
    try:
        done = 0
        for k, upto in enumerate(plan.looks):
            batch = requests[done:upto]
            ref, var = answers.compare(turns, release, variant_dir, done, batch, dtype)
            new = Differences.of(ref, var, first_request=done)
            differences = new if differences is None else differences + new
            done = upto
            looks.append(sequential.look(plan, k, differences.kl, differences.flipped, differences.request_of,
                                         limits))
            _log_look(looks[-1])
            if looks[-1].verdict != "continue":
                break
    finally:
        turns.close()
    if differences is None:
        raise ValidationUnavailable("the probe set is empty")
    last = looks[-1]
    result = _sequential_result(release.path, Path(variant_name or variant_dir), plan, looks, differences,
                                limits, answers, started)
    result["runs"] = {role: usage.to_json() for role, usage in turns.usage.items()}
    result["context"] = inputs.load_context
    if inputs.left_out:  # validation_context cut the probe set to what fits this machine
        result["probes_left_out"] = inputs.left_out
    (variant_dir / VALIDATION).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    what = label or f"{scheme} variant"
    if last.verdict == "fail":
        raise ValidationFailed(f"{what} fails validation: " + ", ".join(result["failed"]), result)
    if last.verdict != "pass":
        raise ValidationUndecided(f"{what}: validation undecided ({', '.join(result['failed'])}); "
                                  f"{sequential.what_would_decide(last)}", result)
    return result


@dataclass
class _ReferenceAnswers:
    """Where the reference's answers come from: a reference file (``--reference-file``), the user cache (as far as
    it covers the probes), else the reference run live, whose answers the cache then keeps."""

    stored: ReferenceFile | None = None
    cache: ReferenceCache | None = None
    dtype: str | None = None  # the reference's compute dtype once known: the variant runs in it
    live: int = 0  # probes the reference answered live in this validation
    context: int | None = None  # the tokens a state is truncated to (ValidationInputs.context)

    @classmethod
    def of(cls, inputs: ValidationInputs, *, dtype: str | None, cache: bool) -> _ReferenceAnswers:
        if inputs.reference is not None:
            return cls(stored=inputs.reference, dtype=dtype or inputs.reference.dtype, context=inputs.context)
        if not cache or inputs.dtype is None or inputs.context is None:
            return cls()
        from clef_local.export.reference_cache import ReferenceCache
        from clef_local.formats.manifest import release_digest

        entry = ReferenceCache.open(inputs.release.path, release_digest(inputs.release.path), inputs.requests,
                                    dtype=inputs.dtype, context=inputs.context)
        return cls(cache=entry, dtype=entry.dtype if entry.covered() else None, context=inputs.context)

    def covered(self) -> int:
        if self.stored is not None:
            return len(self.stored.records)
        return self.cache.covered() if self.cache is not None else 0

    def describe(self) -> dict[str, Any]:
        if self.stored is not None:
            return {"source": "reference file", "path": str(self.stored.path)}
        cached = self.cache.covered() - self.live if self.cache is not None else 0
        out: dict[str, Any] = {"source": "live" if not cached else "user cache", "live": self.live,
                               "cached": cached}
        if self.cache is not None:
            out["cache"] = str(self.cache.path)
        return out

    def compare(self, turns: Turns, release: Release, variant_dir: Path, start: int,
                batch: Sequence[dict[str, Any]], dtype: str | None) -> tuple[list[list[np.ndarray]], ...]:
        """(reference, variant) probabilities of probes ``start ..`` (``batch``): the reference's from the file
        or cache where they cover it, run live beyond (before the variant, whose dtype follows the reference's)."""
        from clef_local.quality import reference_file as files

        known = max(0, min(self.covered() - start, len(batch)))
        live: list[list[np.ndarray]] = []
        if known < len(batch):
            try:
                ran = turns.predict("reference", release, batch[known:], dtype=dtype)
            except (Exception, MemoryError) as exc:
                raise ValidationUnavailable(f"the reference could not be loaded or run ({type(exc).__name__}: "
                                            f"{one_line(exc)})") from exc
            self.dtype = self.dtype or ran.dtype
            live = [p.probabilities for p in ran.predictions]
            self.live += len(batch) - known
            # Turns loads at the longest probe's need, which truncates nothing below self.context (the key)
            if self.cache is not None and ran.dtype == self.cache.dtype:
                self.cache.add(start + known, ran.predictions, {"made by": "quantize's validation"})
            elif self.cache is not None:
                log.warning("the reference ran in %s, not the planned %s: its answers are not cached", ran.dtype,
                            self.cache.dtype)
                self.cache = None
        truncate = self.stored.truncate_state if self.stored is not None else True
        try:
            variant = turns.predict("variant", variant_dir, batch, dtype=self.dtype or dtype, truncate_state=truncate)
        except Exception as exc:
            raise ValidationFailed(f"the variant could not be loaded or run for validation ({type(exc).__name__}: "
                                   f"{one_line(exc)}); pass --no-validate to export without validating") from exc
        known_part: list[list[np.ndarray]] = []
        if known:
            if self.stored is not None:
                files.check_run(self.stored, dtype=variant.dtype, context=self.context)
                part = replace(self.stored, records=self.stored.records[start:start + known])
                known_part = [p.probabilities for p in files.predictions_for(part, variant.predictions[:known])]
            elif self.cache is not None:
                known_part = [p.probabilities for p in self.cache.answers(start, variant.predictions[:known])]
        return known_part + live, [p.probabilities for p in variant.predictions]


def _log_look(look: Any) -> None:
    for name, bound in look.bounds.items():
        log.info("validation look %d (%d requests, %d questions): %-9s %.4g [%.4g, %.4g] vs ≤ %g: %s", look.index + 1,
                 look.requests, look.questions, name, bound.value, bound.lower, bound.upper, bound.limit, bound.state)
    log.info("validation look %d: %s", look.index + 1, look.verdict)


def _sequential_result(reference_dir: Path, variant_dir: Path, plan: Any, looks: Sequence[Any],
                       differences: Differences, limits: Mapping[str, float], answers: _ReferenceAnswers,
                       started: float) -> dict[str, Any]:
    """validation.json's record of a sequential validation: the point figures of the probes used, each gated
    figure's bounds at the last look, every look, and the verdict."""
    last = looks[-1]
    metrics = differences.metrics()
    checks: dict[str, dict[str, Any]] = {}
    for name in METRICS:
        bound = last.bounds.get(name)
        if bound is None:
            checks[name] = {"value": metrics[name], "threshold": None, "ok": True}
        else:
            checks[name] = {"value": metrics[name], "threshold": bound.limit, "lower": bound.lower,
                            "upper": bound.upper, "state": bound.state, "ok": bound.state == "inside"}
    failed = [f"{name} {c['value']:.4g} [{c['lower']:.4g}, {c['upper']:.4g}] "
              f"{'>' if c['state'] == 'outside' else 'straddles'} {c['threshold']:g}"
              for name, c in checks.items() if c["threshold"] is not None and c["state"] != "inside"]
    if last.verdict == "fail":  # a failure names the figures outside; those still open are not the reason
        failed = [line for line in failed if "straddles" not in line]
    passed = last.verdict == "pass"
    return {"validated": passed, "verdict": "undecided" if last.verdict == "continue" else last.verdict,
            "reference": str(reference_dir), "variant": str(variant_dir), "requests": last.requests,
            "probe_set": plan.looks[-1], "questions": metrics["questions"], "flips": metrics["flips"],
            "dtype": answers.dtype or "as stored", "metrics": {k: metrics[k] for k in METRICS},
            "thresholds": dict(limits), "checks": checks, "passed": passed, "failed": failed,
            "sequential": {**plan.to_json(), "schedule": list(plan.looks), "looks": [look.to_json() for look in looks]},
            "reference_answers": answers.describe(), "seconds": round(time.perf_counter() - started, 2),
            **({"reference_file": str(answers.stored.path)} if answers.stored is not None else {})}
