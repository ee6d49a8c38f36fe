"""``clef-local quantize``: write a quantized variant of a release, streaming, atomically, validated.

The layout, config and manifest: docs/format.md §6; usage, GPTQ and the validation: docs/quantization.md. Shard by
shard, each output shard written (and hashed) in the background while the next is quantized, one write in flight at
most, so the peak is about one shard and its quantized copy plus the previous shard's quantized copy;
:mod:`clef_local.export.staging` makes the output appear whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_local.errors import ClefError
from clef_local.export.finish import CONFIG, finish_variant
from clef_local.export.refusal import Keep, check_disk
from clef_local.export.shards import (
    CHUNK_ELEMENTS,
    INDEX,
    ROW_WISE,
    already_4bit,
    first_quantized_weight,
    quantize_shards,
    quantize_tensor,
    release_memory,
    save_shard,
    write_index,
)
from clef_local.export.staging import ExportError, check_paths, resolve_out, staged
from clef_local.export.validate import ValidationRefused, ValidationUndecided
from clef_local.formats.manifest import file_entries
from clef_local.quant import registry

if TYPE_CHECKING:

    from clef_local.quant import Scheme

log = logging.getLogger(__name__)
# the streaming helpers live in .shards; their names stay importable from here
__all__ = ["CHUNK_ELEMENTS", "ROW_WISE", "already_4bit", "build_parser", "main", "quantize_release", "quantize_tensor",
           "release_memory", "save_shard", "summary_lines"]

# the schemes --bits names (int4, int8), by their rows' flags
BITS_TO_SCHEME = {row.bits: name for name, row in registry.SCHEMES.items() if row.flag == f"--bits {row.bits}"}
FOUR_BIT_HINT = ("the source's linear weights already lie on a 4-bit grid per 32 columns (a model dequantized from "
                 "GGUF Q4_0/Q4_1, like the demo backbone): --bits 4 --group-size 32 gives them back up to rounding; "
                 "this scheme re-quantizes them and adds its error on top")
GROUP_FROM_SOURCE = ("32, from the source: its linear weights already lie on a 4-bit grid per 32 columns (a model "
                     "dequantized from GGUF Q4_0/Q4_1, like the demo backbone), which int4 g32 gives back up to "
                     "rounding; pass --group-size to choose another")


def _check_options(scheme: Scheme, int4_grid: str | None, int4_layout: str | None = None) -> dict[str, Any]:
    """The scheme's options: int4's grid rule (default ``mse``) and stored layout (default ``mlx``, MLX affine;
    ``compressed``: compressed-tensors' pack-quantized); refused for the other schemes."""
    from clef_local.quant import int4, int4_packed

    if not scheme.options:  # only int4 takes options
        if given := [f for f, v in (("--int4-grid", int4_grid), ("--int4-layout", int4_layout)) if v is not None]:
            raise ExportError(f"{', '.join(given)} applies to int4 only, not {scheme.name}; drop it")
        return {}
    layout = int4_layout or int4_packed.DEFAULT_LAYOUT
    if layout not in int4_packed.LAYOUTS:
        raise ExportError(f"--int4-layout must be one of {', '.join(int4_packed.LAYOUTS)}, not {layout!r}")
    grid = int4_grid or (int4_packed.DEFAULT_GRID if layout == "compressed" else int4.DEFAULT_GRID)
    if grid not in int4.GRIDS:
        raise ExportError(f"--int4-grid must be one of {', '.join(int4.GRIDS)}, not {grid!r}")
    # the MLX layout's options stay as they were, so its config.json is unchanged
    return {"grid": grid} if layout == int4_packed.DEFAULT_LAYOUT else {"grid": grid, "layout": layout}


def _check_group(scheme: Scheme, group_size: int | None) -> int | None:
    if scheme.default_group_size is None:
        if group_size is not None:
            raise ExportError(f"{scheme.name} has one scale per output channel; it takes no --group-size")
        return None
    group = group_size or scheme.default_group_size
    if scheme.group_sizes and group not in scheme.group_sizes:
        raise ExportError(f"{scheme.name} --group-size must be one of {', '.join(map(str, scheme.group_sizes))}, "
                          f"not {group}")
    if group < 32 or group & (group - 1):
        raise ExportError(f"{scheme.name} --group-size must be a power of two >= 32, not {group}")
    return group


def _linear_modules(source: Path, names: list[str], config: dict[str, Any]) -> list[str]:
    """Names of the backbone's ``nn.Linear`` modules: from the architecture built on the meta device, or (when
    transformers cannot build it) the 2-D ``.weight`` tensors that are not embeddings."""
    try:
        import torch
        import transformers

        hf_config = transformers.AutoConfig.from_pretrained(str(source), trust_remote_code=False)
        cls = getattr(transformers, (hf_config.architectures or [""])[0])
        with torch.device("meta"):
            model = cls(hf_config)
        return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    except Exception as exc:  # an architecture this transformers does not know: fall back to the tensor names
        log.warning("cannot build %s on the meta device (%s); listing linear modules from tensor names", source, exc)
    linear = [n.removesuffix(".weight") for n in names if n.endswith(".weight") and "embed" not in n]
    if config.get("tie_word_embeddings") and "lm_head" not in linear:
        linear.append("lm_head")
    return linear


def _write_config(source: Path, tmp: Path, config: dict[str, Any], scheme: Scheme, group: int | None,
                  result: dict[str, Any], options: dict[str, Any], calibration: dict[str, Any] | None = None, *,
                  validated: bool = True) -> dict[str, Any]:
    done = {n.removesuffix(".weight") for n in result["quantized"]}
    mlx_layout = bool(scheme.top_level_config(group, **options))  # mlx-lm's block: int4 in the MLX layout
    linear = _linear_modules(source, list(result["skipped"]), config) if not mlx_layout else []
    # bitsandbytes' and compressed-tensors' configs name every linear kept as released (their loaders would
    # otherwise expect quantized tensors there); mlx-lm finds int4's quantized layers by their scales
    qconfig = scheme.quantization_config(group, skip_modules=[m for m in linear if m not in done], **options)
    # validated: False only with --no-validate (a variant that fails or cannot run validation is not written)
    qconfig["clef_local"] = {"scheme": scheme.name, "group_size": group, **options,
                             "quantized": len(result["quantized"]), "skipped": result["skipped"],
                             "validated": validated}
    if calibration:
        qconfig["clef_local"]["calibration"] = calibration
    written = {**config, "quantization_config": qconfig, **scheme.top_level_config(group, **options)}
    (tmp / CONFIG).write_text(json.dumps(written, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return qconfig


def quantize_release(source: Path, out: Path, scheme: str, group_size: int | None = None, force: bool = False,
                     validate: bool = True, *, int4_grid: str | None = None, int4_layout: str | None = None,
                     calibrate: bool = False,
                     calibration_requests: int | None = None, log_summary: bool = True,
                     on_tensor: Callable[[str], None] | None = None, max_memory: str | None = None,
                     reference_file: str | Path | None = None, max_length: int | None = None,
                     validation_requests: int | None = None, report: str | Path | None = None,
                     quarantine: str | Path | None = None,
                     validation_data: str | Path | None = None) -> dict[str, Any]:
    """Write the ``scheme`` variant of the release at ``source`` to ``out``; return the summary.

    ``group_size``: int4 group (32/64/128; by default 32 when the source's weights already lie on a 4-bit grid per
    32 columns, as the demo backbone's do, else 64) or nf4 block (default 64); none for int8/fp8. ``int4_grid``:
    how int4 picks each group's scale and bias (``mse``, the default for the MLX layout, or ``mlx``, the default for
    the compressed one; :mod:`clef_local.quant.int4`).
    ``int4_layout``: how int4 is stored (``mlx``, the default: MLX affine, which mlx-lm reads; ``compressed``:
    compressed-tensors' pack-quantized with integer zero points, which vLLM and SGLang read;
    :mod:`clef_local.quant.int4_packed`).
    ``force`` replaces an existing ``out`` once the new variant is complete. ``validate`` compares the variant with the
    source, sequentially, on the packaged probe set (:mod:`clef_local.export.validate`): it passes when the bounds of
    its flip rate and mean KL are inside the scheme's limits, and the export fails when one is outside, when the
    probes are used up undecided, or when validation cannot run (``ValidationUnavailable``: no probe set, too little
    memory, the reference does not load; the first two are found before anything is written: the memory rule is the
    loader's plan, each model streamed from disk when it does not fit, under ``max_memory``). ``reference_file``:
    validate against the reference's probabilities from ``drift --save-reference`` (checked first: its reference,
    probe set and dtype must be this export's) instead of running it; else the reference's answers are kept in the
    user cache for the next variant of this release. ``max_length``: the context validation loads both models at
    (None: the model's default); ``validation_requests``: the most probe requests validation may run (None: the
    scheme's); ``validation_data``: a JSONL file of the user's requests validation runs instead (its first
    ``validation_requests``; read and checked before anything is written). ``validate=False`` writes the variant
    with ``validated: false`` in ``config.json`` and ``validation.json``. A variant validation refuses
    (:class:`ValidationRefused`) is not written; its ``validation.json`` is kept as ``OUT.validation.json`` beside
    ``out``, ``report`` (an HTML path: written whether it passed or not) renders it, and ``quarantine`` (a directory)
    keeps the refused variant whole, marked so that no loader runs it (:mod:`clef_local.export.refusal`); the error
    names each path. An estimate of the variant's bytes larger than the free space beside ``out`` is refused before
    any tensor is read.
    ``calibrate`` rounds with GPTQ on ``calibration_requests`` requests (default 128) instead of round-to-nearest
    (:mod:`clef_local.export.gptq_calibration`; every scheme; it loads the source like validation does).
    ``log_summary`` logs :func:`summary_lines` at INFO (the CLI prints them instead). ``on_tensor(name)`` is
    called after each source tensor is written to its output shard.
    """
    import safetensors.torch  # noqa: F401  (imported before the temp directory exists: it takes seconds)
    import torch  # noqa: F401

    from clef_local import quant
    from clef_local.formats.gguf_release import require_safetensors
    from clef_local.formats.release import read_release
    from clef_local.formats.safetensors import read_header

    started = time.perf_counter()
    source, out = Path(source).expanduser().resolve(), resolve_out(out)
    try:
        spec = quant.get(scheme)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    group = _check_group(spec, group_size)
    options = _check_options(spec, int4_grid, int4_layout)
    if calibrate and options.get("layout") == "compressed":
        raise ExportError("--calibrate rounds int4 onto the MLX layout's grid (float biases), which the compressed "
                          "layout cannot store; drop --calibrate or --int4-layout compressed")
    release = read_release(source)
    require_safetensors(release, "quantize")
    if release.quantization:
        raise ExportError(f"{source} is already quantized ({release.quantization.get('quant_method')}); quantize "
                          f"the BF16 release")
    if calibration_requests is not None and not calibrate:
        raise ExportError("--calibration-requests applies with --calibrate only; add --calibrate or drop it")
    check_paths(source, out, force)  # a bad --out is refused before any work (staged checks again)
    if reference_file is not None and not validate:
        raise ExportError("--reference-file is what validation compares with; drop it or --no-validate")
    if validation_data is not None and not validate:
        raise ExportError("--validation-data is what validation runs on; drop it or --no-validate")
    if not validate and (report is not None or quarantine is not None):
        raise ExportError("--report and --quarantine keep what validation measured; drop them or --no-validate")
    keep = Keep.of(source, out, report=report, quarantine=quarantine, force=force)
    # a source on int4's own grid takes group 32 (found below, from its first weight): the largest int4 estimate
    estimate_group = 32 if spec.needs_divisible_input and group_size is None else group
    check_disk(release, out, spec.name, estimate_group, what=spec.name)
    if validation_requests is None:
        validation_requests = spec.validation_requests
    elif validation_requests < 1:
        raise ExportError(f"--validation-requests {validation_requests}: validation needs at least 1 probe request "
                          f"(default {spec.validation_requests} for {spec.name}; --no-validate skips it)")
    checked = None
    if validate:
        from clef_local.export.validate import check_validation

        # no probe set, too little memory for the reference or the variant, a wrong reference file: refused now,
        # not after minutes of quantizing; validation uses what this found
        checked = check_validation(release, validation_requests, scheme=spec.name, max_memory=max_memory,
                         reference_file=reference_file, max_length=max_length, data=validation_data)
    shards = [f.name for f in release.weight_files]
    for file in release.weight_files:  # a truncated or garbled shard: one ReleaseError naming it, not a traceback
        read_header(file)
    first = first_quantized_weight(source, shards)
    on_grid = first is not None and already_4bit(first)
    del first
    # groups along the input (int4) can take the source's own 32-column grid
    group_from_source = spec.needs_divisible_input and group_size is None and on_grid
    if group_from_source:
        group = 32
        log.info("%s", GROUP_FROM_SOURCE)
    source_4bit = on_grid and not (spec.needs_divisible_input and group == 32)
    if source_4bit:
        log.warning("%s", FOUR_BIT_HINT)
    calibration = None
    if calibrate:  # before the staging directory exists: a refusal or a crash here leaves nothing behind
        from clef_local.export.gptq_calibration import REQUESTS, gptq_tensors

        calibration = gptq_tensors(release, spec.name, group, options, requests=calibration_requests or REQUESTS)
    with staged(source, out, force) as tmp:
        log.info("exporting %s → %s (%s%s) via %s", source, out, spec.name, f", group {group}" if group else "", tmp)
        source_files = file_entries(source)
        result = quantize_shards(source, tmp, shards, spec, group, options,
                                  calibration.packed if calibration else None, on_tensor)
        if (source / INDEX).is_file():
            write_index(source, tmp, result)
        qconfig = _write_config(source, tmp, release.config, spec, group, result, options,
                                calibration.config() if calibration else None, validated=validate)

        def run_validation(tmp: Path) -> dict[str, Any]:
            from clef_local.export.validate import validate_export

            return validate_export(release, tmp, spec.name, validation_requests, variant_name=out,
                                   max_memory=max_memory, max_length=max_length, reference_file=reference_file,
                                   checked=checked, data=validation_data)
        try:
            finished = finish_variant(source, tmp, shards=shards, result=result, source_files=source_files,
                                      scheme=spec.name, group_size=group, fallback_bits=spec.bits_per_weight(group),
                                      validate=run_validation if validate else None)
        except ValidationRefused as exc:  # kept before staged removes tmp
            raise keep.refused(exc, tmp) from exc
    validation, nbytes, bits = finished.validation, finished.nbytes, finished.bits
    keep.passed(validation)
    summary = {"out": str(out), "source": str(source), "scheme": spec.name, "group_size": group, **options,
               "bits_per_weight": bits, "quantized": len(result["quantized"]), "kept": len(result["skipped"]),
               "skipped": result["skipped"], "skipped_by_reason": dict(Counter(result["skipped"].values())),
               "bytes": nbytes, "validation": validation, "seconds": time.perf_counter() - started,
               "source_4bit": source_4bit, "group_from_source": group_from_source,
               "calibration": qconfig["clef_local"].get("calibration")}
    if log_summary:
        for line in summary_lines(summary):
            log.info("%s", line)
    return summary


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB"


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as plain lines: bytes before/after, bits per weight, counts, skipped tensors by reason."""
    b = summary["bytes"]
    lin = b["linear_after"] / b["linear_before"] if b["linear_before"] else float("nan")
    lines = [
        f"{summary['scheme']}{' g' + str(summary['group_size']) if summary['group_size'] else ''}"
        f"{' (' + summary['grid'] + ' grid)' if summary.get('grid') else ''}"
        f"{' in the ' + summary['layout'] + ' layout' if summary.get('layout') else ''} → {summary['out']} "
        f"in {summary['seconds']:.1f} s",
        f"quantized linear weights: {_mb(b['linear_before'])} → {_mb(b['linear_after'])} ({lin:.3f}×), "
        f"{summary['bits_per_weight']:.2f} bits per weight",
        f"whole directory: {_mb(b['total_before'])} → {_mb(b['total_after'])} "
        f"({b['total_after'] / max(b['total_before'], 1):.3f}×)",
        f"tensors: {summary['quantized']} quantized, {summary['kept']} kept as released",
    ]
    if summary.get("group_from_source"):
        lines.append(f"group size: {GROUP_FROM_SOURCE}")
    if cal := summary.get("calibration"):
        lines.append(f"GPTQ on {cal['requests']} calibration requests ({cal['tokens']:,} tokens): output error "
                     f"{cal['output_error_ratio']:.3f}× round-to-nearest's")
    lines += [f"  kept — {reason}: {count} tensor{'s' * (count != 1)}"
              for reason, count in sorted(summary["skipped_by_reason"].items(), key=lambda kv: -kv[1])]
    if summary.get("source_4bit"):
        lines.append(f"note: {FOUR_BIT_HINT}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clef-local quantize",
                                     description="Write a quantized variant (int4, int8, nf4, fp8) of a Clef release: "
                                                 "streamed shard by shard, renamed into place when complete, "
                                                 "validated against the source.")
    parser.add_argument("--model", type=Path, help="source release directory (default: the built-in default model)")
    kind = parser.add_mutually_exclusive_group(required=True)
    kind.add_argument("--bits", type=int, choices=sorted(BITS_TO_SCHEME), help="4 = int4, 8 = int8")
    kind.add_argument("--format", choices=[*registry.SCHEMES, "mixed"],
                      help="the scheme, by name; mixed: a format per group of layers, chosen by measured drift "
                           "(--max-kl; docs/quantization.md#mixed-precision)")
    parser.add_argument("--group-size", type=int,
                        help="int4 group (32, 64, 128; default 32 for a source already on a 4-bit grid per 32 columns, "
                             "such as the demo backbone, else 64) or nf4 block (64)")
    parser.add_argument("--int4-grid", choices=["mse", "mlx"],
                        help="how int4 picks each group's scale and bias: mse (default for the mlx layout: least "
                             "squared error) or mlx (bit-identical to mlx_lm.convert; default for the compressed "
                             "layout)")
    parser.add_argument("--int4-layout", choices=["mlx", "compressed"],
                        help="how int4 is stored: mlx (default: MLX affine with float biases; mlx-lm reads it) or "
                             "compressed (compressed-tensors pack-quantized, integer zero points; vLLM and SGLang "
                             "read it, docs/quantization.md#what-reads-each-variant)")
    parser.add_argument("--calibrate", action="store_true",
                        help="round with GPTQ on calibration requests from the training splits instead of "
                             "round-to-nearest (every scheme; loads the source)")
    parser.add_argument("--calibration-requests", type=int, metavar="N",
                        help="calibration requests for --calibrate (default 128)")
    parser.add_argument("--max-kl", type=float, metavar="NATS",
                        help="--format mixed: the budget, mean KL(source ‖ variant) over the probe questions")
    parser.add_argument("--mixed-formats", metavar="LIST",
                        help="--format mixed: the formats a layer group may take, e.g. int4,int4-g64,int8 "
                             "(default int4,int8; the source precision is always one)")
    parser.add_argument("--group-layers", type=int, metavar="N",
                        help="--format mixed: consecutive decoder layers per group (default 4)")
    parser.add_argument("--selection-requests", type=int, metavar="N",
                        help="--format mixed: probe requests from the training splits the plan is chosen on "
                             "(default 32; validation uses the held-out ones)")
    parser.add_argument("--out", type=Path, required=True, help="the variant directory to write")
    parser.add_argument("--force", action="store_true", help="replace an existing --out (once the new one is done)")
    parser.add_argument("--no-validate", action="store_true",
                        help="write the variant without comparing it with the source (config.json and "
                             "validation.json record validated: false)")
    parser.add_argument("--report", type=Path, metavar="FILE.html",
                        help="write validation's result as an HTML page, whether the variant passed or not")
    parser.add_argument("--quarantine", type=Path, metavar="DIR",
                        help="when validation refuses the variant, keep it whole in DIR, marked quarantined: "
                             "clef-local refuses to load, serve or decide with it (for inspection; its report is "
                             "DIR/validation.json). Without it a refused variant is removed; its validation.json is "
                             "always kept as OUT.validation.json")
    limits = ", ".join(f"{name} {row.validation_requests}" for name, row in registry.SCHEMES.items())
    parser.add_argument("--validation-requests", type=int, metavar="N",
                        help=f"the most probe requests validation may run (default per scheme: {limits}); it stops "
                             "as soon as the bounds decide, and fewer make an undecided verdict likelier; the "
                             "first N of --validation-data")
    parser.add_argument("--validation-data", type=Path, metavar="FILE",
                        help="validate on your own requests: the first --validation-requests of FILE (JSONL, one "
                             "request per line, as clef-local drift --data reads; labels ignored) instead of the "
                             "packaged probe set; checked before anything is written")
    parser.add_argument("--reference-file", type=Path, metavar="FILE",
                        help="validate against the source's probabilities in FILE (clef-local drift --reference "
                             "SOURCE --save-reference FILE, on this machine or another) instead of running it")
    parser.add_argument("--max-memory", help="cap the memory validation plans with (e.g. cpu=6GiB): a model that "
                        "does not fit under it is streamed from disk")
    parser.add_argument("--max-length", type=int, metavar="N",
                        help="the context validation loads both models at (default: the model's, 65,536, or 16,384 "
                             "where that does not fit); the packaged probes reach 4K tokens in the first 64 (16K "
                             "after them), longer states are cut to fit, and a streamed pass is not chunked, so a "
                             "short one lets a streamed reference fit a tight --max-memory")
    return parser


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console()
    for line in summary_lines(summary):
        console.print(line, highlight=False, markup=False)
    validation = summary["validation"]
    if "skipped" in validation:
        console.print(f"validation skipped: {validation['skipped']}", highlight=False, markup=False)
    else:
        from clef_local.export.validate import validation_table

        console.print(validation_table(validation))


EXIT_REFUSED, EXIT_CANNOT_RUN, EXIT_UNDECIDED = 1, 2, 3


def exit_code(exc: ClefError) -> int:
    """``quantize``'s exit status for an error: 1 validation refused the variant (it failed), 3 validation used up
    its probe set without a verdict, 2 anything else (bad arguments or source, no disk space, validation cannot run).
    docs/quantization.md#validation."""
    if isinstance(exc, ValidationUndecided):
        return EXIT_UNDECIDED
    return EXIT_REFUSED if isinstance(exc, ValidationRefused) else EXIT_CANNOT_RUN


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``clef-local quantize``)."""
    from clef_local.options import model_path

    parser = build_parser()
    args = parser.parse_args(argv)
    args.model = model_path(args.model)
    scheme = args.format or BITS_TO_SCHEME[args.bits]
    mixed_flags = {"--max-kl": args.max_kl, "--mixed-formats": args.mixed_formats,
                   "--group-layers": args.group_layers, "--selection-requests": args.selection_requests}
    if scheme == "mixed":
        return _main_mixed(parser, args)
    if given := [flag for flag, value in mixed_flags.items() if value is not None]:
        parser.error(f"{', '.join(given)} apply with --format mixed only")
    try:
        summary = quantize_release(args.model, args.out, scheme, args.group_size, force=args.force,
                                   validate=not args.no_validate, int4_grid=args.int4_grid,
                                   int4_layout=args.int4_layout, calibrate=args.calibrate,
                                   calibration_requests=args.calibration_requests, log_summary=False,
                                   max_memory=args.max_memory, reference_file=args.reference_file,
                                   max_length=args.max_length, validation_requests=args.validation_requests,
                                   report=args.report, quarantine=args.quarantine,
                                   validation_data=args.validation_data)
    except ClefError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_code(exc)
    _print_summary(summary)
    return 0


def _main_mixed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from clef_local.export import mixed

    if args.max_kl is None:
        parser.error("--format mixed needs --max-kl NATS (the mean KL budget, e.g. 0.002)")
    if args.validation_data is not None:
        parser.error("--validation-data applies to a single scheme; --format mixed validates on the packaged probe "
                     "set")
    if given := [f for f, v in {"--group-size": args.group_size, "--int4-grid": args.int4_grid,
                                "--int4-layout": args.int4_layout,
                                "--calibrate": args.calibrate or None,
                                "--calibration-requests": args.calibration_requests}.items() if v is not None]:
        parser.error(f"{', '.join(given)} do not apply to --format mixed (name groups in --mixed-formats: int4-g64)")
    try:
        summary = mixed.mixed_release(args.model, args.out, args.max_kl,
                                      formats=args.mixed_formats or mixed.DEFAULT_FORMATS,
                                      group_layers=args.group_layers or mixed.DEFAULT_GROUP_LAYERS,
                                      selection_requests=args.selection_requests or mixed.DEFAULT_SELECTION_REQUESTS,
                                      force=args.force, validate=not args.no_validate, report=args.report,
                                      quarantine=args.quarantine)
    except ClefError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_code(exc)
    for line in mixed.summary_lines(summary):
        print(line)
    if "skipped" not in summary["validation"]:
        from rich.console import Console

        from clef_local.export.validate import validation_table

        Console().print(validation_table(summary["validation"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
