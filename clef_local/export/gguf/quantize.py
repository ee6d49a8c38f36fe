"""GGUF quantization by llama.cpp's own quantizer (``llama_model_quantize`` through llama-cpp-python), and the tensor
types a GGUF really holds, read back from the file.

The quantizer picks each tensor's type by its own rules (``src/llama-quant.cpp``): a K-quant needs rows that are a
multiple of 256 values, so on a 576-wide model (the demo) most tensors fall back to Q5_0 / Q8_0 and "Q4_K_M" is a
different mix than at Clef's sizes; :func:`tensor_types` says what was really written. ``output.weight`` (or the tied
``token_embd.weight``) — the rows the joint head reads as lexical rows — keeps the source precision by default
(``output_tensor_type``). None of these types needs an importance matrix in llama.cpp (``tensor_requires_imatrix``:
only IQ1_*, IQ2_*, IQ3_XXS and Q2_K in a Q2_K_S file do); IQ4_XS without one is what llama-quantize writes too, and
``--imatrix`` (:mod:`.imatrix`) passes one in memory.
"""

from __future__ import annotations

import ctypes
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_local.export.staging import ExportError

if TYPE_CHECKING:
    from clef_local.export.gguf.imatrix import ImportanceMatrix

# --type -> llama.h's llama_ftype suffix (LLAMA_FTYPE_MOSTLY_*), for the types llama.cpp's quantizer writes
QUANT_TYPES = {"Q8_0": "Q8_0", "Q6_K": "Q6_K", "Q5_K_M": "Q5_K_M", "Q4_K_M": "Q4_K_M", "IQ4_XS": "IQ4_XS"}
# "[  12/ 272] blk.0.attn_q.weight - ..." : one line per tensor in llama.cpp's quantize log
_TENSOR_LINE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")


class _Lines:
    """llama.cpp's log lines while it quantizes (routed to logging as always): tensor lines drive ``progress``,
    error lines are kept for the message."""

    def __init__(self, progress: Callable[[int, int, str], None] | None) -> None:
        self.progress = progress
        self.errors: list[str] = []

    def __call__(self, level: int, line: str) -> None:
        if level >= logging.ERROR:
            self.errors.append(line.strip())
        if self.progress is not None and (match := _TENSOR_LINE.match(line)):
            self.progress(int(match.group(1)), int(match.group(2)), match.group(3))


def quantize_gguf(source: Path, out: Path, qtype: str, *, output_type: str | None, threads: int,
                  progress: Callable[[int, int, str], None] | None = None, imatrix: ImportanceMatrix | None = None
                  ) -> None:
    """Quantize the float GGUF ``source`` to ``out`` as ``qtype`` (a key of :data:`QUANT_TYPES`) with llama.cpp's
    ``llama_model_quantize`` on ``threads`` threads; ``output_type`` (``BF16``, ``F16``, ``F32``; None: llama.cpp's
    rule, Q6_K / Q8_0) is the type of the output rows; ``imatrix`` weighs each column's rounding error
    (:mod:`.imatrix`). A failure is an :class:`ExportError` with llama.cpp's own error line."""
    from gguf import GGMLQuantizationType

    from clef_local.backends.llamacpp_log import listening, llama_cpp_module

    if qtype not in QUANT_TYPES:
        raise ExportError(f"--type {qtype!r} is not one llama.cpp's quantizer writes here; use one of "
                          f"{', '.join(QUANT_TYPES)}")
    llama_cpp = llama_cpp_module()  # its log routed to logging, as the backend's (never reset: stderr)
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{QUANT_TYPES[qtype]}")
    if output_type is not None:
        # ggml_type values: gguf-py's enum mirrors ggml.h (the binding lacks GGML_TYPE_BF16)
        params.output_tensor_type = int(GGMLQuantizationType[output_type])
    keep: list[Any] = []
    if imatrix is not None:
        array, keep = imatrix.c_array()
        keep.append(array)
        params.imatrix = ctypes.cast(array, type(params.imatrix))
    lines = _Lines(progress)
    with listening(lines):
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    del keep  # the quantizer copied the importance matrix
    if status != 0:
        why = lines.errors[-1] if lines.errors else f"llama_model_quantize returned {status}"
        raise ExportError(f"llama.cpp could not quantize {source.name} to {qtype}: {why}")


def tensor_types(path: Path) -> dict[str, Any]:
    """What a GGUF really holds, read back from its tensor table: ``{"counts": {type: n}, "tensors": {name: type},
    "file_type": general.file_type}``."""
    from clef_local.formats.gguf_tensors import gguf_table

    table = gguf_table(path)
    return {"counts": table.type_counts, "tensors": {name: t.type for name, t in table.tensors.items()},
            "file_type": table.file_type}
