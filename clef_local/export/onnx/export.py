"""``clef-local export-onnx``: a release (or int4/int8 variant) as an ONNX Runtime release, validated, atomically.

The output is the source release byte for byte plus ``onnx/`` (docs/format.md §6); why the head stays numpy and the
backbone's weight files stay in the directory: docs/hardware.md#onnx-runtime. The graph is
:mod:`clef_local.export.onnx.graph`, the validation :mod:`clef_local.export.onnx.validate`.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from clef_local.errors import ClefError
from clef_local.export.staging import ExportError, resolve_out, staged
from clef_local.formats.manifest import MANIFEST, check_files, file_entries, list_files, write_manifest
from clef_local.quant import registry

log = logging.getLogger(__name__)

# the schemes whose rows name a MatMulNBits builder (clef_local.export.onnx.graph), best precision first
NBITS_FORMATS = tuple(name for name in registry.by_precision() if registry.get(name).onnx_nbits)
FORMATS = ("fp32", "fp16", *NBITS_FORMATS)
ONNX_DIR = "onnx"
EMBEDDING = "output_embedding.npy"


def _embedding_array(embedding: np.ndarray, dtype: str) -> tuple[np.ndarray, str]:
    """The output embedding as stored: BF16 as uint16 bits (exact: the float32 copy came from BF16), else as is."""
    if dtype == "bfloat16":
        return (embedding.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16), "bfloat16"
    if dtype == "float16":
        return embedding.astype(np.float16), "float16"
    return embedding.astype(np.float32), "float32"


def _resolve_format(fmt: str | None, scheme: str | None, source: Path) -> str:
    if fmt is None:
        return scheme or "fp32"
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if scheme is not None and fmt != scheme:
        raise ExportError(f"{source} is an {scheme} variant; export it with --format {scheme} (or export the BF16 "
                          f"release with --format {fmt})")
    return fmt


def _copy_release(source: Path, tmp: Path) -> None:
    for name in list_files(source):
        if name == MANIFEST:
            continue
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, tmp / name)


def _write_onnx(tmp: Path, fmt: str) -> dict[str, Any]:
    """Trace the text model of the release at ``tmp`` and write ``tmp/onnx``; return ``onnx_config.json``."""
    import torch

    import clef_local
    from clef_local.export.onnx import graph as onnx_graph
    from clef_local.formats.release import read_release

    release = read_release(tmp)
    dtype = torch.float16 if fmt == "fp16" else torch.float32
    started = time.perf_counter()
    backbone = onnx_graph.load_exportable(release, dtype)
    vocab = int(release.text_config.get("vocab_size") or backbone.output_embedding.shape[0])
    graph = onnx_graph.export_graph(backbone.module, vocab, qwen3_5=release.is_qwen3_5)
    replaced = onnx_graph.insert_nbits(graph, backbone.nbits) if backbone.nbits else 0
    if replaced:
        log.info("%d linear layers → MatMulNBits (%s, block %s)", replaced, fmt,
                 sorted({w.block_size for w in backbone.nbits.values()}))
    directory = tmp / ONNX_DIR
    log.info("writing %s", directory)
    onnx_graph.save_graph(graph, directory)
    stored, stored_dtype = _embedding_array(backbone.output_embedding, release.dtype)
    np.save(directory / EMBEDDING, stored)
    nbits = {"layers": replaced, "bits": sorted({w.bits for w in backbone.nbits.values()}),
             "block_sizes": sorted({w.block_size for w in backbone.nbits.values()})} if replaced else None
    config = {"format": fmt, "dtype": "float16" if fmt == "fp16" else "float32", "model": "model.onnx",
              "inputs": list(onnx_graph.INPUTS), "output": onnx_graph.OUTPUT,
              "output_embedding": {"file": EMBEDDING, "dtype": stored_dtype, "shape": list(stored.shape)},
              "matmul_nbits": nbits, "source_scheme": backbone.scheme, "tool_version": clef_local.__version__,
              "torch": torch.__version__, "seconds": round(time.perf_counter() - started, 1)}
    (directory / "onnx_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    del backbone, graph
    gc.collect()
    return config


def export_onnx(source: str | Path, out: str | Path, fmt: str | None = None, *, force: bool = False,
                validate: bool = True, probes: int = 64) -> dict[str, Any]:
    """Write the ONNX release of ``source`` to ``out``; return a summary (config, validation, seconds)."""
    import torch  # noqa: F401  (imported before the temp directory exists: it takes seconds)

    import clef_local
    from clef_local.backends.torch_backend import variant_scheme
    from clef_local.export.quantize import quantize_release
    from clef_local.formats.gguf_release import require_safetensors
    from clef_local.formats.release import read_release

    started = time.perf_counter()
    source, out = Path(source).expanduser().resolve(), resolve_out(out)
    release = read_release(source)
    require_safetensors(release, "export-onnx")  # before the release is copied to a staging directory
    fmt = _resolve_format(fmt, variant_scheme(release.config), source)
    if validate:  # no probe set: refused now, not after the export (ValidationUnavailable)
        from clef_local.export.onnx.validate import parity_requests

        parity_requests(probes)
    with staged(source, out, force) as tmp:
        log.info("exporting %s → %s (%s) via %s", source, out, fmt, tmp)
        if fmt in NBITS_FORMATS and variant_scheme(release.config) is None:
            tmp.rmdir()  # quantize_release writes the variant there (atomically, through its own sibling)
            log.info("quantizing %s to %s first (clef-local quantize's functions)", source, fmt)
            quantize_release(source, tmp, fmt, validate=False, log_summary=False)
            (tmp / MANIFEST).unlink()
        else:
            _copy_release(source, tmp)
        config = _write_onnx(tmp, fmt)
        validation: dict[str, Any] = {"skipped": "--no-validate"}
        if validate:
            from clef_local.export.onnx.validate import validate_onnx

            validation = validate_onnx(tmp, fmt, n=probes)
        write_manifest(tmp, tool="clef-local", version=clef_local.__version__, onnx=config,
                       scheme={"name": fmt, "source_scheme": config["source_scheme"]},
                       source={"path": str(source), "files": file_entries(source)})
        if problems := check_files(tmp):
            raise ExportError("the written ONNX release does not check: " + "; ".join(problems))
    onnx_bytes = sum(f.stat().st_size for f in (out / ONNX_DIR).iterdir())
    return {"out": str(out), "source": str(source), "format": fmt, "config": config, "validation": validation,
            "onnx_bytes": onnx_bytes, "seconds": time.perf_counter() - started}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clef-local export-onnx",
        description="Export a Clef release (or int4/int8 variant) for ONNX Runtime: the text model as onnx/model.onnx "
                    "(MatMulNBits for quantized linears), validated against the torch backend, written atomically.")
    parser.add_argument("--model", type=Path, help="source release or variant (default: the built-in default model)")
    parser.add_argument("--out", type=Path, required=True, help="the ONNX release directory to write")
    parser.add_argument("--format", choices=FORMATS,
                        help="fp32 (default for a BF16/FP32 release), fp16 (for CUDA), int8/int4 (MatMulNBits; a BF16 "
                             "release is quantized first, a variant keeps its own scheme)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out (once the new one is done)")
    parser.add_argument("--probes", type=int, default=64, help="validation probe requests (default 64)")
    parser.add_argument("--no-validate", action="store_true", help="skip the comparison with the torch backend")
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``clef-local export-onnx``): 0 done, 1 validation failed, 2 refused / bad source."""
    from clef_local.export.validate import ValidationFailed

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("onnx_ir").setLevel(logging.WARNING)  # one line per deduplicated initializer otherwise
    from clef_local.options import model_path

    args.model = model_path(args.model)
    try:
        summary = export_onnx(args.model, args.out, args.format, force=args.force, validate=not args.no_validate,
                              probes=args.probes)
    except ClefError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, ValidationFailed) else 2
    from rich.console import Console

    console = Console()
    nbits = summary["config"]["matmul_nbits"]
    console.print(f"{summary['format']} → {summary['out']} in {summary['seconds']:.1f} s; onnx/ "
                  f"{summary['onnx_bytes'] / 1e6:,.1f} MB" + (f"; {nbits['layers']} MatMulNBits layers" if nbits
                                                              else ""), highlight=False, markup=False)
    validation = summary["validation"]
    if "skipped" in validation:
        console.print(f"validation skipped: {validation['skipped']}", highlight=False, markup=False)
    else:
        from clef_local.export.onnx.validate import validation_table

        console.print(validation_table(validation))
    return 0


if __name__ == "__main__":
    sys.exit(main())
