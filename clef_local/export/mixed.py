"""``clef-local quantize --format mixed --max-kl X``: a format per group of decoder layers, chosen by measured drift.

1. **Measure** (:func:`measure_groups`). The source is loaded once (torch, float32, no state cache) and answers the
   selection requests — the probe set drawn from the *training* splits (BANKING77 train, NLU++ folds 0–15, as GPTQ's
   calibration), never the validation probes. Then, for each group of ``--group-layers`` consecutive decoder
   layers and each candidate format, that group's linear weights are replaced by their quantize → dequantize round
   trip (the weights a variant computes with on the dequantize kernel), the rest stay in the source precision, and
   the mean KL(source ‖ that model) over the selection questions is recorded; the weights are then put back.
2. **Choose** (:func:`choose_formats`). Each group gets the format that makes the stored bytes smallest under
   Σ KL ≤ budget — a multiple-choice knapsack solved exactly on a grid of budget / :data:`GRID` (each cost rounded
   up, so the grid's solution never exceeds the budget), assuming the groups' contributions add (to first order
   they do: KL is quadratic in small moves of the logits).
3. **Check**. The whole plan at once is measured on the selection requests; where the groups interact and the sum
   underestimates it, the budget is tightened in proportion and the choice redone (at most :data:`ROUNDS` times;
   keeping every group in the source precision always passes).
4. **Write** shard by shard (:func:`clef_local.export.shards.quantize_shards`), the plan per layer in
   ``config.json`` (:mod:`clef_local.formats.quant_plan`, inside ``quantization_config.clef_local``).
5. **Validate** the whole variant against the source on the held-out validation probe set (BANKING77 test, NLU++
   folds 16–19) at mean KL ≤ the budget (:func:`clef_local.export.validate.validate_export`), in float32 like the
   measurements: the budget is what quantization moves, not bf16's arithmetic.

The source must fit in memory beside its activations (checked first, as for validation).
docs/quantization.md#mixed-precision.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clef_local.export.finish import CONFIG, finish_variant
from clef_local.export.refusal import Keep, check_disk
from clef_local.export.shards import (
    INDEX,
    already_4bit,
    first_quantized_weight,
    quantize_shards,
    quantize_tensor,
    write_index,
)
from clef_local.export.staging import ExportError, check_paths, resolve_out, staged
from clef_local.formats.manifest import file_entries
from clef_local.formats.quant_plan import MIXED, SOURCE, LayerFormat, layer_index
from clef_local.quant import registry

if TYPE_CHECKING:
    import torch

    from clef_local.formats.release import Release
    from clef_local.model import ClefModel
    from clef_local.quant import Scheme

log = logging.getLogger(__name__)

DEFAULT_FORMATS = "int4,int8"
DEFAULT_GROUP_LAYERS = 4
DEFAULT_SELECTION_REQUESTS = 32
GRID = 2000  # KL grid steps per budget in the knapsack
ROUNDS = 6  # re-plans when the whole plan's KL exceeds the budget


@dataclass(frozen=True)
class Candidate:
    """A format a group may take: a scheme and its group size (int4, nf4)."""

    scheme: str
    group_size: int | None = None

    @property
    def label(self) -> str:
        return LayerFormat(self.scheme, self.group_size).label


def parse_formats(text: str, int4_group: int) -> list[Candidate]:
    """``"int4,int4-g64,int8"`` → candidates (``int4`` alone takes ``int4_group``, the source's default); the
    source precision is always a choice too. :class:`ExportError` names a bad entry."""
    from clef_local import quant

    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        scheme, _, group_text = part.partition("-g")
        try:
            spec = quant.get(scheme)
        except ValueError as exc:
            raise ExportError(f"--mixed-formats {part!r}: {exc}") from None
        group = int(group_text) if group_text.isdigit() else None
        if group_text and group is None:
            raise ExportError(f"--mixed-formats {part!r}: write a group size as int4-g64")
        if spec.default_group_size is None and group is not None:
            raise ExportError(f"--mixed-formats {part!r}: {scheme} has one scale per row; it takes no group size")
        if spec.group_sizes:  # int4: the source's default group unless one is written
            group = group or int4_group
            if group not in spec.group_sizes:
                raise ExportError(f"--mixed-formats {part!r}: {scheme} groups are "
                                  f"{', '.join(map(str, spec.group_sizes))}")
        elif spec.default_group_size is not None:
            group = group or spec.default_group_size
        out.append(Candidate(scheme, group))
    if not out or len(set(out)) != len(out):
        raise ExportError(f"--mixed-formats {text!r}: name one or more distinct formats, e.g. {DEFAULT_FORMATS}")
    return out


def layer_groups(layers: int, per_group: int) -> list[list[int]]:
    """Decoder layers 0 … layers−1 in consecutive groups of ``per_group`` (the last may be shorter)."""
    if per_group < 1:
        raise ExportError(f"--group-layers must be ≥ 1, got {per_group}")
    return [list(range(start, min(start + per_group, layers))) for start in range(0, layers, per_group)]


def _options(candidate: Candidate) -> dict[str, Any]:
    from clef_local import quant

    return dict(quant.get(candidate.scheme).options)


def round_trip(spec: Scheme, weight: torch.Tensor, group: int | None, options: Mapping[str, Any]
               ) -> tuple[torch.Tensor, int]:
    """``weight`` quantized and dequantized (float32) as the variant will hold it, and the stored bytes."""
    import torch

    packed = quantize_tensor(spec, weight, group, **options)
    nbytes = sum(v.numel() * v.element_size() for v in packed.values())
    # int4's packed words are uint32; its unpacking masks the bits, which an int32 view does the same
    viewed = {k: v.view(torch.int32) if v.dtype == torch.uint32 else v for k, v in packed.items()}
    return spec.dequantize(viewed, group, torch.float32), nbytes


def _mean_kl(reference: Sequence[Sequence[np.ndarray]], model: ClefModel, requests: Sequence[dict[str, Any]]) -> float:
    from clef_local.export.validate import compare

    variant = [p.probabilities for p in model.predict(requests, truncate_state=True)]
    return float(compare(reference, variant)["mean_kl"])


class Bench:
    """The source loaded for measuring: its linear modules by weight name, the source tensors, the reference."""

    def __init__(self, source: Path | Release, requests: Sequence[dict[str, Any]]) -> None:
        import torch
        from safetensors import safe_open

        import clef_local
        from clef_local.formats.release import Release
        from clef_local.quant.predicate import should_quantize

        self.model = clef_local.load(source, backend="torch", device="cpu", dtype="float32", state_cache=0)
        source = source.path if isinstance(source, Release) else source
        module = getattr(getattr(self.model.backend, "backbone", None), "model", None)
        if not isinstance(module, torch.nn.Module):
            raise ExportError(f"{source}: the torch backend did not give a backbone module to measure on")
        self.requests = list(requests)
        self.weights: dict[str, torch.Tensor] = {}  # the source tensors of every quantizable linear, as stored
        self.modules: dict[str, Any] = {}
        for file in self.model.release.weight_files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                    if should_quantize(name, tuple(f.get_slice(name).get_shape()), None)[0]:
                        self.weights[name] = f.get_tensor(name)
                        try:
                            self.modules[name] = module.get_submodule(name.removesuffix(".weight"))
                        except AttributeError:
                            raise ExportError(f"{name}: no such module in the backbone to measure") from None
        self.reference = [p.probabilities for p in self.model.predict(self.requests, truncate_state=True)]

    def names(self, layers: Sequence[int]) -> list[str]:
        wanted = set(layers)
        return [n for n in self.weights if layer_index(n) in wanted]

    def apply(self, formats: Mapping[str, Candidate | None]) -> dict[str, int]:
        """Put each weight named in ``formats`` in its format (None: the source); the stored bytes of each."""
        import torch

        from clef_local import quant
        from clef_local.quant.predicate import should_quantize

        sizes = {}
        with torch.no_grad():
            for name, candidate in formats.items():
                weight, target = self.weights[name], self.modules[name].weight
                spec = quant.get(candidate.scheme) if candidate is not None else None
                if candidate is None or spec is None or not should_quantize(
                        name, tuple(weight.shape), spec.predicate_group_size(candidate.group_size))[0]:
                    target.copy_(weight.to(target.dtype))
                    sizes[name] = weight.numel() * weight.element_size()
                    continue
                values, sizes[name] = round_trip(spec, weight, candidate.group_size, _options(candidate))
                target.copy_(values.to(target.dtype))
        return sizes

    def kl(self) -> float:
        return _mean_kl(self.reference, self.model, self.requests)


def measure_groups(bench: Bench, groups: Sequence[Sequence[int]], candidates: Sequence[Candidate],
                   progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Per group: its layers, its bytes in the source precision, and for each candidate format its stored bytes
    and the mean KL with that group alone in it."""
    out = []
    total, done = len(groups) * len(candidates), 0
    for layers in groups:
        names = bench.names(layers)
        entry: dict[str, Any] = {"layers": list(layers), "source_bytes": sum(bench.apply(dict.fromkeys(names))
                                                                              .values()), "formats": {}}
        for candidate in candidates:
            sizes = bench.apply(dict.fromkeys(names, candidate))
            kl = bench.kl() if names else 0.0
            entry["formats"][candidate.label] = {"bytes": sum(sizes.values()), "kl": kl}
            bench.apply(dict.fromkeys(names))
            done += 1
            if progress is not None:
                progress(done, total)
            log.info("layers %s-%s as %s: mean KL %.3g", layers[0], layers[-1], candidate.label, kl)
        out.append(entry)
    return out


def choose_formats(measured: Sequence[Mapping[str, Any]], candidates: Sequence[Candidate],
                   budget: float) -> list[Candidate | None]:
    """The format of each group (None: the source precision) that minimizes the bytes with Σ KL ≤ ``budget``
    (module docstring, step 2); ties go to the smaller KL."""
    if budget <= 0:
        raise ExportError(f"--max-kl must be > 0, got {budget}; e.g. 0.002 (nats, mean over the probe questions)")
    unit = budget / GRID
    inf = float("inf")
    best = np.full(GRID + 1, inf)
    best[0] = 0.0
    picks: list[np.ndarray] = []
    for entry in measured:
        options: list[tuple[Candidate | None, float, int]] = [(None, 0.0, entry["source_bytes"])]
        options += [(c, entry["formats"][c.label]["kl"], entry["formats"][c.label]["bytes"]) for c in candidates]
        nxt, pick = np.full(GRID + 1, inf), np.full(GRID + 1, -1)
        for k, (_, kl, size) in enumerate(options):
            cost = math.ceil(max(kl, 0.0) / unit - 1e-9) if kl > 0 else 0
            if cost > GRID:
                continue
            shifted = np.full(GRID + 1, inf)
            shifted[cost:] = best[: GRID + 1 - cost] + size
            better = shifted < nxt
            nxt[better], pick[better] = shifted[better], k
        best = nxt
        picks.append(pick)
    end = int(np.argmin(best))  # fewest bytes; argmin takes the lowest KL among equal bytes
    chosen: list[Candidate | None] = []
    for entry, pick in zip(reversed(measured), reversed(picks), strict=True):
        k = int(pick[end])
        options_c: list[Candidate | None] = [None, *candidates]
        choice = options_c[k]
        chosen.append(choice)
        kl = 0.0 if choice is None else entry["formats"][choice.label]["kl"]
        end -= math.ceil(max(kl, 0.0) / unit - 1e-9) if kl > 0 else 0
    return list(reversed(chosen))


def plan_layers(groups: Sequence[Sequence[int]], chosen: Sequence[Candidate | None]) -> dict[int, LayerFormat]:
    """{layer: format} of a choice per group (None: the source precision)."""
    return {layer: LayerFormat(c.scheme, c.group_size) if c else LayerFormat(SOURCE)
            for layers, c in zip(groups, chosen, strict=True) for layer in layers}


def select_plan(bench: Bench, groups: Sequence[Sequence[int]], candidates: Sequence[Candidate], budget: float,
                progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Measure, choose and check (module docstring, steps 1–3): the plan and the record that goes into config.json."""
    measured = measure_groups(bench, groups, candidates, progress)
    target, rounds = budget, []
    for _ in range(ROUNDS):
        chosen = choose_formats(measured, candidates, target)
        predicted = sum(0.0 if c is None else m["formats"][c.label]["kl"] for m, c in zip(measured, chosen,
                                                                                          strict=True))
        bench.apply({n: c for layers, c in zip(groups, chosen, strict=True) for n in bench.names(layers)})
        whole = bench.kl()
        rounds.append({"budget": target, "predicted_kl": predicted, "measured_kl": whole,
                       "formats": [c.label if c else SOURCE for c in chosen]})
        log.info("plan at budget %.3g: predicted KL %.3g, measured %.3g", target, predicted, whole)
        if whole <= budget:
            break
        target *= 0.9 * budget / whole  # the groups interact: ask the sum for less, in proportion
    else:
        chosen = [None] * len(groups)  # every group in the source precision: KL 0, always within the budget
        rounds.append({"budget": 0.0, "predicted_kl": 0.0, "measured_kl": 0.0, "formats": [SOURCE] * len(groups)})
    bench.apply(dict.fromkeys(bench.weights))
    return {"max_kl": budget, "chosen": chosen, "layers": plan_layers(groups, chosen),
            "record": {"max_kl": budget, "groups": [{**m, "format": c.label if c else SOURCE}
                                                    for m, c in zip(measured, chosen, strict=True)],
                       "rounds": rounds, "selection_kl": rounds[-1]["measured_kl"]}}


def _chooser(plan: Mapping[int, LayerFormat]) -> Callable[[str], Any]:
    from clef_local import quant

    def choose(name: str) -> Any:
        index = layer_index(name)
        fmt = plan.get(index) if index is not None else None
        if fmt is None or fmt.scheme == SOURCE:
            return None
        return quant.get(fmt.scheme), fmt.group_size, _options(Candidate(fmt.scheme, fmt.group_size))

    return choose


def _decoder_layers(config: Mapping[str, Any], names: Sequence[str]) -> int:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    count = text.get("num_hidden_layers") if isinstance(text, dict) else None
    found = [i for n in names if (i := layer_index(n)) is not None]
    return int(count) if isinstance(count, int) else (max(found) + 1 if found else 0)


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="pass", desc="measuring layer groups", disable=None, dynamic_ncols=True)


def mixed_release(source: Path, out: Path, max_kl: float, *, formats: str = DEFAULT_FORMATS,
                  group_layers: int = DEFAULT_GROUP_LAYERS, selection_requests: int = DEFAULT_SELECTION_REQUESTS,
                  force: bool = False, validate: bool = True, seed: int = 0,
                  validation_requests: int | None = None, report: str | Path | None = None,
                  quarantine: str | Path | None = None) -> dict[str, Any]:
    """Write the mixed-precision variant of ``source`` to ``out`` whose mean KL stays within ``max_kl`` (module
    docstring); returns the summary. ``formats``: the candidates (``int4`` takes the source's default group: 32 when
    the weights already lie on a 4-bit grid per 32 columns, as the demo backbone's do, else 64). ``report``,
    ``quarantine`` and the disk check: as :func:`clef_local.export.quantize.quantize_release`'s."""
    import safetensors.torch  # noqa: F401  (imported before the temp directory exists: it takes seconds)

    from clef_local.data.probes import probe_requests
    from clef_local.export.validate import ValidationUnavailable, check_validation
    from clef_local.formats.gguf_release import require_safetensors
    from clef_local.formats.release import read_release
    from clef_local.formats.safetensors import read_header

    started = time.perf_counter()
    source, out = Path(source).expanduser().resolve(), resolve_out(out)
    release = read_release(source)
    require_safetensors(release, "quantize")
    if release.quantization:
        raise ExportError(f"{source} is already quantized ({release.quantization.get('quant_method')}); quantize "
                          "the BF16 release")
    if not max_kl > 0:
        raise ExportError(f"--max-kl must be > 0, got {max_kl}; e.g. 0.002 (nats, mean over the probe questions)")
    check_paths(source, out, force)
    if not validate and (report is not None or quarantine is not None):
        raise ExportError("--report and --quarantine keep what validation measured; drop them or --no-validate")
    keep = Keep.of(source, out, report=report, quarantine=quarantine, force=force)
    check_disk(release, out, None, None, what="mixed")  # at most the source's bytes: known before the plan is
    check_validation(release)  # the source is loaded to measure: it must fit, with the probe set readable
    shards = [f.name for f in release.weight_files]
    for file in release.weight_files:
        read_header(file)
    first = first_quantized_weight(source, shards)
    int4_group = 32 if first is not None and already_4bit(first) else 64
    del first
    candidates = parse_formats(formats, int4_group)
    try:
        requests = probe_requests(selection_requests, seed, split="train")
    except (FileNotFoundError, OSError, ValueError) as exc:
        raise ValidationUnavailable(f"the selection probes (training splits) cannot be read ({exc})") from exc
    bench = Bench(release, requests)
    groups = layer_groups(_decoder_layers(release.config, list(bench.weights)), group_layers)
    bar = _progress_bar(len(groups) * len(candidates))
    try:
        chosen = select_plan(bench, groups, candidates, max_kl, progress=lambda d, _t: bar.update(d - bar.n))
    finally:
        bar.close()
        del bench
    record = {**chosen["record"], "selection": f"{len(requests)} probe requests from the training splits (seed {seed})"}
    summary = write_mixed(release, out, chosen["layers"], record, max_kl=max_kl, force=force, validate=validate,
                          validation_requests=validation_requests, keep=keep)
    return {**summary, "candidates": [c.label for c in candidates], "group_layers": group_layers,
            "seconds": time.perf_counter() - started}


def write_mixed(source: Path | Release, out: Path, plan: Mapping[int, LayerFormat], record: Mapping[str, Any], *,
                max_kl: float, force: bool = False, validate: bool = True,
                validation_requests: int | None = None, keep: Keep | None = None) -> dict[str, Any]:
    """Write ``source`` with each decoder layer in its ``plan`` format (steps 4–5 of the module docstring);
    ``record`` (how the plan was chosen) goes into config.json beside it; validated at mean KL ≤ ``max_kl``.
    ``source`` may be the :class:`Release` already read (passed on, not read again). ``keep``: what a refusal keeps
    (:class:`clef_local.export.refusal.Keep`; default: ``OUT.validation.json`` only)."""
    from clef_local.export.validate import THRESHOLDS, ValidationRefused, validate_export
    from clef_local.formats.release import Release, read_release

    release = source if isinstance(source, Release) else read_release(Path(source).expanduser().resolve())
    source, out = release.path, resolve_out(out)
    shards = [f.name for f in release.weight_files]
    used = {fmt.scheme for fmt in plan.values() if fmt.scheme != SOURCE}
    strictest = min(t["flip_rate"] for t in THRESHOLDS.values())  # no layer quantized
    thresholds = {"mean_kl": max_kl, "flip_rate": max((THRESHOLDS[s]["flip_rate"] for s in used), default=strictest)}
    if validation_requests is None:  # the probes its flip limit needs, as for the scheme whose limit it is
        validation_requests = max(row.validation_requests for row in registry.SCHEMES.values()
                                  if row.validation["flip_rate"] == thresholds["flip_rate"])
    keep = keep or Keep.of(source, out, force=force)
    check_disk(release, out, None, None, what="mixed")
    with staged(source, out, force) as tmp:
        source_files = file_entries(source)
        result = quantize_shards(source, tmp, shards, None, None, {}, choose=_chooser(plan))
        if (source / INDEX).is_file():
            write_index(source, tmp, result)
        member = {"scheme": MIXED, "layers": {str(i): fmt.to_json() for i, fmt in sorted(plan.items())},
                  "plan": dict(record), "quantized": len(result["quantized"]), "skipped": result["skipped"],
                  "validated": validate}
        config = {**release.config, "quantization_config": {"quant_method": "clef-local-mixed", "clef_local": member}}
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

        def run_validation(tmp: Path) -> dict[str, Any]:
            return validate_export(release, tmp, MIXED, n=validation_requests, dtype="float32", variant_name=out,
                                   thresholds=thresholds)
        try:
            finished = finish_variant(source, tmp, shards=shards, result=result, source_files=source_files,
                                      scheme=MIXED, group_size=None, fallback_bits=16.0,
                                      validate=run_validation if validate else None)
        except ValidationRefused as exc:  # kept before staged removes tmp
            raise keep.refused(exc, tmp) from exc
    validation, nbytes, bits = finished.validation, finished.nbytes, finished.bits
    keep.passed(validation)
    return {"out": str(out), "source": str(source), "scheme": MIXED, "max_kl": max_kl, "plan": dict(record),
            "layers": {i: fmt.label for i, fmt in plan.items()}, "bits_per_weight": bits, "bytes": nbytes,
            "quantized": len(result["quantized"]), "kept": len(result["skipped"]), "validation": validation}


def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """The mixed export as plain lines: each group's measured KL per format and its choice, then sizes and KL."""
    plan = summary["plan"]
    labels = summary["candidates"]
    lines = [f"mixed (≤ {summary['max_kl']:g} mean KL) → {summary['out']} in {summary['seconds']:.1f} s",
             "layers     " + "".join(f"{'KL ' + label:>16}" for label in labels) + "   chosen"]
    for group in plan["groups"]:
        layers = group["layers"]
        cells = "".join(f"{group['formats'][label]['kl']:>16.3g}" for label in labels)
        lines.append(f"{layers[0]:>3}-{layers[-1]:<6}{cells}   {group['format']}")
    last = plan["rounds"][-1]
    b = summary["bytes"]
    lines += [f"selection set: predicted KL {last['predicted_kl']:.3g} (sum of the groups), measured "
              f"{last['measured_kl']:.3g} ({len(plan['rounds'])} round{'s' * (len(plan['rounds']) != 1)})",
              f"linear weights: {b['linear_before'] / 1e6:,.2f} MB → {b['linear_after'] / 1e6:,.2f} MB, "
              f"{summary['bits_per_weight']:.2f} bits per quantized weight; whole directory "
              f"{b['total_before'] / 1e6:,.2f} → {b['total_after'] / 1e6:,.2f} MB"]
    return lines
