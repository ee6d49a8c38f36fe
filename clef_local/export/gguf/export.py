"""``clef-local export-gguf``: a release as a GGUF release (:mod:`clef_local.formats.gguf_release`), atomically.

The text backbone is converted to a float GGUF (:mod:`.convert`: F32 / F16 / BF16 directly), then, for a quantized
``--type``, quantized by llama.cpp's own quantizer (:mod:`.quantize`) and the float file deleted. The release's small
files are copied byte for byte (the joint head and its config among them), ``gguf/gguf_config.json`` says what wrote
the file and which tensor types it really holds, and the manifest lists everything with its SHA-256. The whole
directory is staged beside ``--out`` and renamed into place only when complete (:mod:`clef_local.export.staging`:
a killed run leaves nothing at ``--out`` and is cleaned up by the next one); the disk space is checked first.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clef_local.errors import ClefError
from clef_local.export.gguf.convert import FLOAT_TYPES, converter_for, source_tensors
from clef_local.export.gguf.quantize import QUANT_TYPES
from clef_local.export.refusal import Keep
from clef_local.export.staging import ExportError, resolve_out, staged
from clef_local.export.validation_errors import ValidationRefused
from clef_local.formats.gguf_release import (
    GGUF_CONFIG,
    GGUF_CONFIG_FORMAT,
    GGUF_DIR,
    GGUF_FILE,
    VISION_PATH,
    is_backbone_weight,
)
from clef_local.formats.manifest import MANIFEST, check_files, file_entries, files_digest, list_files, write_manifest
from clef_local.units import format_size

log = logging.getLogger(__name__)

TYPES = (*QUANT_TYPES, *FLOAT_TYPES)
DEFAULT_TYPE = "Q4_K_M"
SOURCE_PRECISION = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
FLOAT_STAGE = ".float.gguf"  # the float GGUF a quantized export starts from (hidden: never listed, deleted after)
# A quantized file is at most Q8_0's 8.5 bits a weight (every fallback type is smaller) of a 16-bit float file
QUANT_RATIO = 8.5 / 16
SLACK_BYTES = 1 << 20


def _source_precision(release: Any) -> str:
    name = release.dtype
    if name not in SOURCE_PRECISION:
        raise ExportError(f"{release.path}: a {name} backbone; export-gguf converts BF16, F16 or F32 releases")
    return SOURCE_PRECISION[name]


def estimate_bytes(release: Any, qtype: str) -> dict[str, int]:
    """An upper bound of the bytes the export holds at once, from the safetensors headers: the float GGUF
    (``float``: the text tensors at the source precision, F32 for F32 types), the quantized file (``final``) and the
    copied files and tensors (``other``)."""
    sources = source_tensors(release.weight_files)
    converter = converter_for(release.config)
    plans = converter.plan({**release.config, **release.text_config}, {n: i.shape for n, (_, i) in sources.items()})
    width = 4 if qtype == "F32" or _source_precision(release) == "F32" else 2
    floats = sum(math.prod(p.shape) * width for p in plans)
    output = sum(math.prod(p.shape) * width for p in plans if p.name == "output.weight")
    final = floats if qtype in FLOAT_TYPES else int(QUANT_RATIO * floats) + output
    other = sum((release.path / n).stat().st_size for n in list_files(release.path) if not is_backbone_weight(n))
    other += sum(i.nbytes for n, (_, i) in sources.items() if converter.torch_prefixes
                 and n.startswith(converter.torch_prefixes))  # the vision tower, copied
    return {"float": floats if qtype not in FLOAT_TYPES else 0, "final": final, "other": other,
            "total": (floats if qtype not in FLOAT_TYPES else 0) + final + other + SLACK_BYTES}


def check_disk(release: Any, out: Path, qtype: str) -> int:
    """Refuse (before any tensor is read) an export whose :func:`estimate_bytes` exceeds the free space beside
    ``out``, where it is staged."""
    need = estimate_bytes(release, qtype)
    free = shutil.disk_usage(out.parent).free
    log.info("disk: the %s export needs about %s at its peak (float GGUF %s, final %s, other files %s), %s free",
             qtype, format_size(need["total"]), format_size(need["float"]), format_size(need["final"]),
             format_size(need["other"]), format_size(free))
    if need["total"] > free:
        raise ExportError(f"not enough disk space for {out}: the {qtype} export needs about "
                          f"{format_size(need['total'])} at its peak and {out.parent} has {format_size(free)} free; "
                          f"free {format_size(need['total'] - free)} there or choose an --out on another disk "
                          f"(nothing was written)")
    return need["total"]


def _copy_small_files(source: Path, tmp: Path) -> list[str]:
    """Every file of the release but its safetensors backbone and its manifest, byte for byte."""
    copied = []
    for name in list_files(source):
        if name == MANIFEST or is_backbone_weight(name):
            continue
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, tmp / name)
        copied.append(name)
    return copied


def _copy_torch_tensors(release: Any, path: Path) -> dict[str, Any] | None:
    """The tensors the converter leaves on torch (a vision tower) into one safetensors file at ``path``, their bytes
    as stored; None when the release has none."""
    from clef_local.formats.safetensors import read_arrays
    from clef_local.synthetic import Stored, safetensors_header

    prefixes = converter_for(release.config).torch_prefixes
    kept = {n: v for n, v in source_tensors(release.weight_files).items() if prefixes and n.startswith(prefixes)}
    if not kept:
        return None
    stored = [Stored(name, info.dtype, info.shape, fill=None) for name, (_, info) in kept.items()]  # type: ignore[arg-type]
    with path.open("wb") as out:
        out.write(safetensors_header(stored))
        for name, (header, _) in kept.items():
            out.write(read_arrays(header.path, {name}.__contains__, header=header)[name].tobytes())
    return {"file": path.relative_to(path.parent.parent).as_posix(), "tensors": len(kept),
            "bytes": path.stat().st_size}


def _bar(enabled: bool, desc: str) -> Callable[[int, int, str], None]:
    """A tqdm bar over tensors, fed ``(done, total, name)``."""
    from tqdm.auto import tqdm

    state: dict[str, Any] = {}

    def update(done: int, total: int, name: str) -> None:
        if "bar" not in state:
            state["bar"] = tqdm(total=total, unit="tensor", desc=desc, disable=not enabled, file=sys.stderr)
        bar = state["bar"]
        bar.set_postfix_str(name, refresh=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


def export_gguf(source: str | Path, out: str | Path, qtype: str = DEFAULT_TYPE, *, force: bool = False,
                validate: bool = True, probes: int | None = None, quantize_output: bool = False,
                threads: int | None = None, imatrix: bool = False, imatrix_requests: int = 64, progress: bool = False,
                max_memory: str | None = None, report: str | Path | None = None,
                quarantine: str | Path | None = None) -> dict[str, Any]:
    """Write the GGUF release of ``source`` to ``out``; return a summary (the gguf_config.json written, seconds).

    ``quantize_output``: let llama.cpp choose the output rows' type (Q6_K / Q8_0) instead of keeping the source
    precision the joint head reads exactly. ``threads``: llama.cpp's quantizer threads (default: the project's rule,
    :func:`clef_local.planning.hardware.thread_plan`). ``imatrix``: weigh the quantizer's rounding by an importance
    matrix of ``imatrix_requests`` calibration requests (:mod:`.imatrix`). Validation (unless ``validate`` is
    False) runs at most ``probes`` probes (None: the type's :func:`.validate.default_probes`), each model under
    ``max_memory``; a refused GGUF keeps its report as quantize's does (``OUT.validation.json``, ``report``,
    ``quarantine``: :class:`clef_local.export.refusal.Keep`)."""
    import clef_local
    from clef_local.export.gguf import validate as gguf_validate
    from clef_local.export.gguf.convert import write_gguf
    from clef_local.formats.gguf_release import check_gguf
    from clef_local.formats.release import read_release, write_json

    started = time.perf_counter()
    if qtype not in TYPES:
        raise ExportError(f"--type must be one of {', '.join(TYPES)}, not {qtype!r}")
    source, out = Path(source).expanduser().resolve(), resolve_out(out)
    release = read_release(source)
    if release.is_gguf:
        raise ExportError(f"{source} is already a GGUF release; export from the BF16 release it came from")
    if release.quantization is not None:
        raise ExportError(f"{source} is a quantized variant; export-gguf quantizes itself: export the BF16 release "
                          f"it came from")
    converter = converter_for(release.config)
    precision = _source_precision(release)
    output_type = None if quantize_output or qtype == "F32" else precision
    if imatrix and qtype not in QUANT_TYPES:
        raise ExportError(f"--imatrix weighs a quantizer's rounding; --type {qtype} is not quantized (use one of "
                          f"{', '.join(QUANT_TYPES)})")
    if not validate and (report is not None or quarantine is not None):
        raise ExportError("--report and --quarantine keep what validation measured; drop them or --no-validate")
    keep = Keep.of(source, out, report=report, quarantine=quarantine, force=force)
    checked = None
    if validate:  # refused now (no probes, no memory for the reference), not after the conversion
        probes = gguf_validate.default_probes(qtype) if probes is None else probes
        if probes < 1:
            raise ExportError(f"--validation-requests {probes}: validation needs at least 1 probe (--no-validate "
                              "skips it)")
        checked = gguf_validate.check(release, qtype, probes, max_memory=max_memory)
    if qtype in QUANT_TYPES:
        import llama_cpp  # noqa: F401  (missing: refused now, naming the extra, not after the conversion)
    with staged(source, out, force) as tmp:
        check_disk(release, out, qtype)
        log.info("exporting %s → %s (%s, %s) via %s", source, out, qtype, converter.arch, tmp)
        copied = _copy_small_files(source, tmp)
        (tmp / GGUF_DIR).mkdir()
        target = tmp / GGUF_DIR / GGUF_FILE
        matrix = None
        if qtype in FLOAT_TYPES:
            written = write_gguf(release, target, qtype, output_type=output_type,
                                 progress=_bar(progress, f"convert {qtype}"))
        else:
            from clef_local.export.gguf.quantize import quantize_gguf
            from clef_local.planning.hardware import thread_plan

            staged_float = tmp / GGUF_DIR / FLOAT_STAGE
            written = write_gguf(release, staged_float, precision, output_type=output_type,
                                 progress=_bar(progress, f"convert {precision}"))
            if imatrix:
                from clef_local.export.gguf.imatrix import importance_matrix

                matrix = importance_matrix(release, written.plans, requests=imatrix_requests,
                                           include_output=output_type is None)
            n_threads = thread_plan(threads=threads, role="command").intra_op
            log.info("quantizing to %s with llama.cpp (%d threads)", qtype, n_threads)
            quantize_gguf(staged_float, target, qtype, output_type=output_type, threads=n_threads,
                          progress=_bar(progress, f"quantize {qtype}"), imatrix=matrix)
            staged_float.unlink()
        vision = _copy_torch_tensors(release, tmp / VISION_PATH)
        source_files = file_entries(source)
        config = _gguf_config(target, qtype, written, output_type, source, files_digest(source_files))
        config["vision"] = vision or "none: the release has no vision tower"
        config["imatrix"] = matrix.describe() if matrix is not None else False
        write_json(tmp / GGUF_DIR / GGUF_CONFIG, config)
        validation: dict[str, Any] = {"skipped": "--no-validate"}
        if checked is not None:
            try:
                validation = gguf_validate.validate_gguf(release, tmp, qtype, checked, out=out, max_memory=max_memory)
            except ValidationRefused as exc:  # kept before staged removes tmp
                raise keep.refused(exc, tmp) from exc
        config["validation"] = {key: validation[key] for key in ("verdict", "requests", "metrics")
                                if key in validation} or validation
        write_json(tmp / GGUF_DIR / GGUF_CONFIG, config)
        write_manifest(tmp, tool="clef-local", version=clef_local.__version__, gguf=config,
                       scheme={"name": f"gguf-{qtype.lower()}", "source_scheme": None},
                       source={"path": str(source), "files": source_files})
        if problems := check_files(tmp):
            raise ExportError("the written GGUF release does not check: " + "; ".join(problems))
        check_gguf(target, read_release(tmp), hashed=True)
    keep.passed(validation)
    log.info("wrote %s (%d files copied beside gguf/%s, %s)", out, len(copied), GGUF_FILE,
             format_size((out / GGUF_DIR / GGUF_FILE).stat().st_size))
    return {"out": str(out), "source": str(source), "type": qtype, "config": config, "validation": validation,
            "gguf_bytes": (out / GGUF_DIR / GGUF_FILE).stat().st_size, "seconds": time.perf_counter() - started}


def _gguf_config(target: Path, qtype: str, written: Any, output_type: str | None, source: Path,
                 digest: str) -> dict[str, Any]:
    """``gguf_config.json``: what wrote the file and what it really holds (read back from it)."""
    from importlib.metadata import PackageNotFoundError, version

    import clef_local
    from clef_local.export.gguf.quantize import tensor_types

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    held = tensor_types(target)
    return {
        "format": GGUF_CONFIG_FORMAT, "type": qtype, "file_type": held["file_type"], "architecture": written.arch,
        "tensor_types": held["counts"], "tensor_count": len(held["tensors"]),
        "lm_head_tensor": written.lm_head_tensor, "output_tensor_type": held["tensors"][written.lm_head_tensor],
        "output_kept_at_source_precision": output_type is not None, "imatrix": False,
        "pre_tokenizer": written.pre_tokenizer, "vision": None,
        "writer": {"clef_local": clef_local.__version__, "gguf": installed("gguf"),
                   "llama_cpp_python": installed("llama_cpp_python") if qtype in QUANT_TYPES else None},
        "source": {"path": str(source), "digest": digest},
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clef-local export-gguf",
        description="Export a Clef release's text backbone as a GGUF for llama.cpp (quantized by llama.cpp's own "
                    "quantizer), with the joint head, tokenizer and configs beside it, written atomically.")
    parser.add_argument("--model", type=Path, help="source release (default: the built-in default model)")
    parser.add_argument("--out", type=Path, required=True, help="the GGUF release directory to write")
    parser.add_argument("--type", default=DEFAULT_TYPE, choices=TYPES,
                        help=f"GGUF type (default {DEFAULT_TYPE}); F32/F16/BF16 are written directly, the others by "
                             f"llama.cpp's quantizer")
    parser.add_argument("--quantize-output", action="store_true",
                        help="let llama.cpp quantize the output rows too (default: kept at the source precision, "
                             "so the joint head's lexical rows are exact)")
    parser.add_argument("--imatrix", action="store_true",
                        help="weigh the quantizer's rounding by an importance matrix of calibration requests (the "
                             "decision probes' shapes, from the training splits) run through the torch backbone")
    parser.add_argument("--imatrix-requests", type=int, default=64, metavar="N",
                        help="calibration requests for --imatrix (default 64)")
    parser.add_argument("--threads", type=int, help="quantizer threads (default: every physical core)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out (once the new one is done)")
    parser.add_argument("--validation-requests", type=int, metavar="N",
                        help="the most validation probes the sequential verdict may use (default: 1024 for 8-bit "
                             "and float types, 256 for the 4-6 bit ones, as int8 and int4)")
    parser.add_argument("--max-memory", metavar="CAP", help="cap each validation load, e.g. cpu=6GiB")
    parser.add_argument("--report", type=Path, metavar="FILE.html",
                        help="write the validation report as HTML, whether the GGUF passed or not")
    parser.add_argument("--quarantine", type=Path, metavar="DIR",
                        help="when validation refuses the GGUF, keep it whole in DIR, marked quarantined")
    parser.add_argument("--no-validate", action="store_true",
                        help="write the GGUF release without comparing it with the reference (recorded so)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``clef-local export-gguf``): 0 done, 1 validation failed, 3 undecided, 2 refused / bad
    source."""
    from clef_local.export.validate import ValidationFailed, ValidationUndecided
    from clef_local.options import model_path

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("gguf").setLevel(logging.WARNING)  # gguf-py logs every file it writes at INFO
    args.model = model_path(args.model)
    try:
        summary = export_gguf(args.model, args.out, args.type, force=args.force, validate=not args.no_validate,
                              probes=args.validation_requests, quantize_output=args.quantize_output,
                              threads=args.threads,
                              imatrix=args.imatrix, imatrix_requests=args.imatrix_requests,
                              progress=not args.no_progress, max_memory=args.max_memory, report=args.report,
                              quarantine=args.quarantine)
    except ClefError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, ValidationFailed) else 3 if isinstance(exc, ValidationUndecided) else 2
    config = summary["config"]
    types = ", ".join(f"{name} {count}" for name, count in config["tensor_types"].items())
    print(f"{summary['type']} → {summary['out']} in {summary['seconds']:.1f} s; gguf/{GGUF_FILE} "
          f"{summary['gguf_bytes'] / 1e6:,.1f} MB; tensors: {types}; {config['lm_head_tensor']} "
          f"{config['output_tensor_type']}")
    validation = summary["validation"]
    if "skipped" in validation:
        print(f"validation skipped: {validation['skipped']}")
    else:
        print(f"validation: {validation.get('verdict')} after {validation.get('requests')} probes "
              f"({', '.join(f'{k} {v:.4g}' for k, v in (validation.get('metrics') or {}).items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
