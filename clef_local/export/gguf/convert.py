"""A release's text backbone as an F32 / F16 / BF16 GGUF, streamed tensor by tensor (clef-local export-gguf, step 1).

What is written follows llama.cpp's ``convert_hf_to_gguf.py`` (``conversion/llama.py`` ``LlamaModel``,
``conversion/qwen.py`` ``Qwen3_5TextModel`` with ``--no-mtp``): the same tensor names, transforms, metadata keys
and per-tensor types, so that llama.cpp loads the file as it loads its own conversions. :func:`registry` has one
converter (:class:`~clef_local.export.gguf.plan.Converter`) per release backbone
(:data:`clef_local.formats.gguf_release.ARCHITECTURES`); each names its tensors and writes its hyperparameters. The
safetensors are read with clef-local's own memory-mapped reader, one tensor at a time (tensors that need no transform
in row blocks): an 18.8 GB release is converted with a few hundred MB of memory.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clef_local.errors import ReleaseError
from clef_local.export.gguf import llama, qwen35
from clef_local.export.gguf.plan import Converter, TensorPlan, keeps_float32
from clef_local.formats.safetensors import Header, TensorInfo, bf16_to_float32, read_arrays, read_header

log = logging.getLogger(__name__)

# --type values this module writes without llama.cpp (float formats): name -> (gguf.GGMLQuantizationType name,
# gguf.LlamaFileType name)
FLOAT_TYPES = {"F32": ("F32", "ALL_F32"), "F16": ("F16", "MOSTLY_F16"), "BF16": ("BF16", "MOSTLY_BF16")}
SOURCE_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}  # safetensors dtype -> GGML type of the same precision
_BLOCK_BYTES = 64 << 20  # rows converted at a time for an untransformed tensor


def registry() -> dict[str, Converter]:
    """The converters by release backbone: ``llama`` (the demo model, tiny llama releases) and ``qwen3_5`` (Clef,
    Clef-flash, tiny Qwen3.5 releases: the text model only)."""
    return {c.backbone: c for c in (llama.CONVERTER, qwen35.CONVERTER)}


def converter_for(config: dict[str, Any]) -> Converter:
    """The :class:`Converter` of a release ``config.json``."""
    from clef_local.formats.gguf_release import backbone_of

    return registry()[backbone_of(config)]


# -- reading -----------------------------------------------------------------------------------------------------


def source_tensors(weight_files: tuple[Path, ...]) -> dict[str, tuple[Header, TensorInfo]]:
    """Every tensor of the release's safetensors (headers checked once): name -> (its file's header, info)."""
    found: dict[str, tuple[Header, TensorInfo]] = {}
    for file in weight_files:
        header = read_header(file)
        for name, info in header.tensors.items():
            found[name] = (header, info)
    return found


def _float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return bf16_to_float32(raw)
    if dtype in ("F32", "F16"):
        return raw.astype(np.float32)
    raise ReleaseError(f"a {dtype} backbone tensor; export-gguf converts a BF16, F16 or F32 release (not a "
                       f"quantized variant: export its source release)")


def _encode(values: np.ndarray, ggml_type: str) -> np.ndarray:
    """float32 values in the GGUF storage of ``ggml_type`` (BF16 rounded to nearest even by gguf-py, as llama.cpp's
    converter does), as the array whose bytes are written."""
    if ggml_type == "F32":
        return values.astype("<f4", copy=False)
    if ggml_type == "F16":
        return values.astype("<f2")
    import gguf

    return gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16).view("<u2")


class _Blocks:
    """A tensor as ``GGUFWriter.write_tensor_data`` writes it (it needs ``nbytes`` and ``tofile``): untransformed
    tensors in row blocks, never whole in memory; a transformed one (norms, linear-attention projections: small)
    computed whole."""

    def __init__(self, raw: np.ndarray, dtype: str, ggml_type: str, plan: TensorPlan) -> None:
        self.raw, self.dtype, self.ggml_type = raw, dtype, ggml_type
        self.values: np.ndarray | None = None
        self.nbytes = math.prod(plan.shape) * (4 if ggml_type == "F32" else 2)
        if plan.transform is not None:
            values = np.ascontiguousarray(plan.transform(_float32(raw, dtype)), np.float32)
            if values.shape != plan.shape:
                raise ReleaseError(f"{plan.source} has shape {list(raw.shape)}; the GGUF tensor {plan.name} needs "
                                   f"{list(plan.shape)} after its transform: the release's config does not match its "
                                   f"weights")
            self.values = _encode(values, ggml_type)
        elif math.prod(raw.shape) != math.prod(plan.shape):
            raise ReleaseError(f"{plan.source} has shape {list(raw.shape)}, not {list(plan.shape)}")

    def tofile(self, fout: Any) -> None:
        if self.values is not None:
            self.values.tofile(fout)
            return
        if SOURCE_TYPES.get(self.dtype) == self.ggml_type:  # same precision: the bytes as stored
            rows = self.raw.reshape(-1, self.raw.shape[-1]) if self.raw.ndim > 1 else self.raw.reshape(1, -1)
            step = max(1, _BLOCK_BYTES // max(1, rows[0].nbytes))
            for start in range(0, rows.shape[0], step):
                np.ascontiguousarray(rows[start:start + step]).tofile(fout)
            return
        rows = self.raw.reshape(-1, self.raw.shape[-1]) if self.raw.ndim > 1 else self.raw.reshape(1, -1)
        step = max(1, _BLOCK_BYTES // max(1, 4 * rows.shape[1]))
        for start in range(0, rows.shape[0], step):
            _encode(_float32(rows[start:start + step], self.dtype), self.ggml_type).tofile(fout)


# -- writing -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Written:
    """What :func:`write_gguf` wrote: the architecture, the per-tensor GGML types, the tokenizer's pre name."""

    arch: str
    tensor_types: dict[str, str]
    pre_tokenizer: str
    lm_head_tensor: str
    plans: list[TensorPlan]


def tensor_type(plan: TensorPlan, ftype: str, output_type: str | None) -> str:
    """The GGML type ``plan`` is written in for the float file type ``ftype`` (F32 / F16 / BF16); ``output_type``
    overrides the type of ``output.weight`` (the head's lexical rows, kept at the source precision)."""
    if keeps_float32(plan.name, plan.shape):
        return "F32"
    if output_type is not None and plan.name == "output.weight":
        return output_type
    return FLOAT_TYPES[ftype][0]


def write_gguf(release: Any, out: Path, ftype: str, *, output_type: str | None = None,
               progress: Callable[[int, int, str], None] | None = None) -> Written:
    """Write the text backbone of ``release`` (a :class:`clef_local.formats.release.Release` with safetensors
    weights) to ``out`` as a GGUF of float type ``ftype`` (``F32``, ``F16``, ``BF16``); ``progress(done, total, name)``
    is called after each tensor."""
    import gguf

    import clef_local
    from clef_local.export.gguf.vocab import write_vocab

    if ftype not in FLOAT_TYPES:
        raise ValueError(f"write_gguf writes {', '.join(FLOAT_TYPES)}, not {ftype!r}")
    converter = converter_for(release.config)
    text = {**release.config, **release.text_config}  # llama.cpp's hparams: text_config moved to the top level
    sources = source_tensors(release.weight_files)
    plans = converter.plan(text, {name: info.shape for name, (_, info) in sources.items()})
    tied = not any(p.name == "output.weight" for p in plans)
    writer = gguf.GGUFWriter(None, converter.arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(release.path.name)
    writer.add_string("general.source.clef_local", clef_local.__version__)
    converter.parameters(writer, text)
    writer.add_file_type(getattr(gguf.LlamaFileType, FLOAT_TYPES[ftype][1]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab = write_vocab(writer, release.path, int(text["vocab_size"]), space_prefix=converter.space_prefix)
    types: dict[str, str] = {}
    for plan in plans:
        ggml_type = tensor_type(plan, ftype, output_type)
        types[plan.name] = ggml_type
        itemsize = 4 if ggml_type == "F32" else 2
        dtype = np.dtype("<f4") if ggml_type == "F32" else np.dtype("<f2") if ggml_type == "F16" else np.dtype("<u2")
        writer.add_tensor_info(plan.name, plan.shape, dtype, math.prod(plan.shape) * itemsize,
                               raw_dtype=getattr(gguf.GGMLQuantizationType, ggml_type))
    writer.write_header_to_file(path=out)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    try:
        for done, plan in enumerate(plans, 1):
            header, info = sources[plan.source]
            raw = read_arrays(header.path, {plan.source}.__contains__, header=header)[plan.source]
            writer.write_tensor_data(_Blocks(raw, info.dtype, types[plan.name], plan))  # duck-typed: nbytes, tofile
            if progress is not None:
                progress(done, len(plans), plan.name)
    finally:
        writer.close()
    return Written(converter.arch, types, vocab.pre, "token_embd.weight" if tied else "output.weight", plans)

