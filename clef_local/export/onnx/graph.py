"""The ONNX graph of a release's text model (docs/format.md §3), and its ``MatMulNBits`` nodes.

``torch.onnx.export(dynamo=True)`` traces the text model (quantized linears as plain ones holding the dequantized
weight, only to trace); each of their ``MatMul`` nodes then becomes a ``MatMulNBits`` built from the variant's own
tensors, re-laid out, never re-quantized. The exact mapping: docs/hardware.md#onnx-runtime.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clef_local.errors import ClefError
from clef_local.quant import registry

if TYPE_CHECKING:
    import onnx_ir
    import torch

    from clef_local.formats.release import Release

log = logging.getLogger(__name__)

INPUTS = ("input_ids", "attention_mask")
OUTPUT = "last_hidden_state"
MS_DOMAIN = "com.microsoft"
INT8_BLOCKS = (128, 64, 32, 16)
WRAPPED = "text_model"  # attribute of the wrapper: every name scope of the graph starts with it


class OnnxExportError(ClefError, ValueError):
    """The ONNX export cannot be made for this release (unsupported scheme, a node it cannot place, ...)."""


@dataclass(frozen=True)
class NBitsWeight:
    """The tensors and attributes of one ``MatMulNBits`` node (``B`` [N, blocks, block·bits/8] uint8)."""

    bits: int
    block_size: int
    k: int
    n: int
    packed: np.ndarray
    scales: np.ndarray  # float32 [N, blocks]
    zero_points: np.ndarray | None  # float32 [N, blocks] or None (the default 2^(bits-1))


def int4_nbits(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int) -> NBitsWeight:
    """MatMulNBits tensors of one int4 layer in the MLX layout (uint32 ``weight`` [N, K/8], ``scales``/``biases``
    [N, K/g] as float32): the same 4-bit codes, byte for byte."""
    n, words = weight.shape
    k = words * 8
    if k % group_size or scales.shape != (n, k // group_size) or biases.shape != scales.shape:
        raise OnnxExportError(f"int4 layer: weight {list(weight.shape)}, scales {list(scales.shape)} do not fit "
                              f"group size {group_size}")
    packed = np.ascontiguousarray(weight.astype("<u4", copy=False)).view(np.uint8)
    scales32 = scales.astype(np.float32)
    zero_points = (-biases.astype(np.float32) / scales32).astype(np.float32)
    return NBitsWeight(4, group_size, k, n, packed.reshape(n, k // group_size, group_size // 2), scales32,
                       zero_points)


def int4_module_nbits(module: Any, packed: dict[str, np.ndarray]) -> NBitsWeight:
    """:func:`int4_nbits` of an int4 module's MLX-layout tensors (its row's ``onnx_nbits``)."""
    return int4_nbits(packed["weight"], packed["scales"], packed["biases"], module.group_size)


def int8_module_nbits(module: Any, packed: dict[str, np.ndarray]) -> NBitsWeight:
    """:func:`int8_nbits` of an int8 module's tensors (its row's ``onnx_nbits``)."""
    return int8_nbits(packed["weight"], packed["weight_scale"])


def int8_block_size(k: int) -> int:
    """The block size of an 8-bit MatMulNBits node for ``K`` inputs (the scale is per row, so any works)."""
    return next((b for b in INT8_BLOCKS if k % b == 0), 32)


def int8_nbits(q: np.ndarray, weight_scale: np.ndarray) -> NBitsWeight:
    """MatMulNBits tensors of one int8 layer (int8 ``q`` [N, K], float32 ``weight_scale`` [N, 1]): ``q + 128``."""
    n, k = q.shape
    block = int8_block_size(k)
    blocks = -(-k // block)
    codes = np.full((n, blocks * block), 128, dtype=np.uint8)  # a padded tail decodes to 0 (and K masks it anyway)
    codes[:, :k] = (q.astype(np.int16) + 128).astype(np.uint8)
    scales = np.repeat(weight_scale.reshape(n, 1).astype(np.float32), blocks, axis=1)
    return NBitsWeight(8, block, k, n, codes.reshape(n, blocks, block), scales, None)


class TextModelWrapper:
    """Factory of the traced module: ``forward(input_ids, attention_mask) -> last_hidden_state``."""

    @staticmethod
    def build(text_model: torch.nn.Module) -> torch.nn.Module:
        import torch

        class TextModel(torch.nn.Module):
            def __init__(self, inner: torch.nn.Module) -> None:
                super().__init__()
                setattr(self, WRAPPED, inner)

            def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
                out = getattr(self, WRAPPED)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                             return_dict=True)
                return out.last_hidden_state

        return TextModel(text_model).eval()


@dataclass
class ExportableBackbone:
    """A backbone ready to trace: the wrapper module, the output embedding, the quantized layers' tensors."""

    module: Any  # torch.nn.Module (the wrapper)
    output_embedding: np.ndarray  # float32 [vocab, hidden]
    nbits: dict[str, NBitsWeight]  # wrapper module path -> MatMulNBits tensors
    scheme: str | None


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    import torch

    if tensor.dtype == torch.uint32:
        return tensor.view(torch.int32).numpy().view(np.uint32)
    return tensor.detach().float().numpy() if tensor.is_floating_point() else tensor.numpy()


def load_exportable(release: Release, dtype: torch.dtype) -> ExportableBackbone:
    """The release's text model in ``dtype`` with each quantized linear turned back into an ``nn.Linear`` (its
    dequantized weight, for tracing only) and its stored tensors kept as :class:`NBitsWeight`."""
    import torch
    import transformers

    from clef_local.backends.quantized import Int4Linear, QuantizedLinear
    from clef_local.backends.skeleton import load_variant_backbone
    from clef_local.backends.torch_backend import TorchBackbone, variant_scheme

    scheme = variant_scheme(release.config)
    if scheme is not None and (scheme not in registry.SCHEMES or registry.get(scheme).onnx_nbits is None):
        raise OnnxExportError(f"{release.path} is a {scheme} variant; the ONNX export takes a BF16/FP32 release or "
                              f"an int4/int8 variant (MatMulNBits); export the BF16 release with --format int4|int8")
    if scheme is None:
        model = TorchBackbone(release.path, release.config, dtype=dtype, weight_files=release.weight_files).model
    else:
        cls = (transformers.Qwen3_5ForConditionalGeneration if release.is_qwen3_5
               else transformers.AutoModelForCausalLM)
        model = load_variant_backbone(cls, release.path, release.weight_files, scheme, dtype).eval()
    model.config.use_cache = False
    base = model.model
    text_model = getattr(base, "language_model", base)
    wrapper = TextModelWrapper.build(text_model)
    nbits: dict[str, NBitsWeight] = {}
    for name, module in list(wrapper.named_modules()):
        if not isinstance(module, QuantizedLinear):
            continue
        # int4 in either stored layout, as the MLX-layout tensors MatMulNBits is built from (Int4Linear.affine)
        stored = module.affine() if isinstance(module, Int4Linear) else module.packed()
        packed = {k: _to_numpy(v) for k, v in stored.items()}
        builder = registry.get(module.scheme).onnx_nbits  # not None: the variant's scheme was checked above
        build: Callable[[Any, dict[str, np.ndarray]], NBitsWeight] = globals()[str(builder)]
        nbits[name] = build(module, packed)
        linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(module.dequantize(dtype))
            if module.bias is not None:
                linear.bias.copy_(module.bias.to(dtype))
        parent, _, child = name.rpartition(".")
        setattr(wrapper.get_submodule(parent), child, linear)
    embedding = model.get_output_embeddings().weight.detach().float().numpy()
    return ExportableBackbone(wrapper, embedding, nbits, scheme)


def export_graph(module: torch.nn.Module, vocab_size: int, *, qwen3_5: bool = False) -> onnx_ir.Model:
    """Trace ``module`` with the dynamo exporter (dynamic batch and sequence) and return the ONNX IR model.

    ``qwen3_5``: the linear-attention layers become ``GatedDeltaNet`` nodes (:mod:`clef_local.export.onnx.gdn`)."""
    import contextlib

    import torch

    patch: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    table = None
    if qwen3_5:
        from clef_local.export.onnx import gdn as onnx_gdn

        patch, table = onnx_gdn.gated_delta_patch(), onnx_gdn.TRANSLATION

    ids = torch.randint(0, max(2, vocab_size), (2, 17), dtype=torch.int64)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # a padded record, so the mask path is traced with real padding
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    started = time.perf_counter()
    log.info("tracing the text model with torch.onnx.export(dynamo=True) (about a minute for 135M parameters)")
    with patch:
        program = torch.onnx.export(
            module, (ids, mask), dynamo=True, input_names=list(INPUTS), output_names=[OUTPUT],
            dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
            optimize=True, verbose=False, custom_translation_table=table)
    log.info("traced in %.1f s", time.perf_counter() - started)
    return program.model


def _scope_module(node: onnx_ir.Node) -> str | None:
    """The module path (in the wrapper) of the node's innermost module, from the exporter's name scopes."""
    import ast

    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if not scopes:
        return None
    names = ast.literal_eval(scopes)
    return names[-2] if len(names) >= 2 else None


def insert_nbits(model: onnx_ir.Model, nbits: dict[str, NBitsWeight]) -> int:
    """Replace the ``MatMul`` of every layer in ``nbits`` by a ``MatMulNBits`` node; return how many.

    The weight initializer the MatMul read (the transposed dequantized weight) is dropped. Every layer must be
    found exactly once, else :class:`OnnxExportError` (a silent full-precision layer would pass for quantized)."""
    import onnx_ir as ir

    graph = model.graph
    found: dict[str, int] = {}
    for node in list(graph):
        path = _scope_module(node) if node.op_type == "MatMul" else None
        if path is None or path not in nbits:
            continue
        spec = nbits[path]
        x, w = node.inputs
        if w is None or w.const_value is None or tuple(w.const_value.shape) != (spec.k, spec.n):
            raise OnnxExportError(f"{path}: its MatMul does not read a [{spec.k}, {spec.n}] weight initializer")
        inputs = [x]
        for suffix, array in (("B", spec.packed), ("scales", spec.scales), ("zero_points", spec.zero_points)):
            if array is None:
                continue
            value = ir.Value(name=f"{path}.nbits.{suffix}", const_value=ir.tensor(array, name=f"{path}.nbits.{suffix}"))
            graph.register_initializer(value)
            inputs.append(value)
        new = ir.Node(MS_DOMAIN, "MatMulNBits", inputs, attributes={
            "K": ir.AttrInt64("K", spec.k), "N": ir.AttrInt64("N", spec.n), "bits": ir.AttrInt64("bits", spec.bits),
            "block_size": ir.AttrInt64("block_size", spec.block_size)}, name=f"{path}.MatMulNBits",
            metadata_props=dict(node.metadata_props))
        ir.convenience.replace_nodes_and_values(graph, node, [node], [new], node.outputs, new.outputs)
        new.outputs[0].name = node.outputs[0].name if node.outputs[0].name else new.outputs[0].name
        if not w.uses() and w.name is not None and w.name in graph.initializers:
            graph.initializers.pop(w.name)
        found[path] = found.get(path, 0) + 1
    missing = sorted(set(nbits) - set(found))
    twice = sorted(p for p, c in found.items() if c > 1)
    if missing or twice:
        raise OnnxExportError(f"MatMulNBits placement failed: no MatMul found for {missing[:5]}, several for "
                              f"{twice[:5]}; the exported graph's name scopes are not what this exporter expects")
    if MS_DOMAIN not in model.opset_imports:
        model.opset_imports[MS_DOMAIN] = 1
    return len(found)


def save_graph(model: onnx_ir.Model, directory: Path, name: str = "model.onnx") -> list[Path]:
    """Write ``name`` with every initializer in one external ``name.data`` file; return the files written."""
    import onnx_ir as ir

    directory.mkdir(parents=True, exist_ok=True)
    ir.save(model, directory / name, external_data=f"{name}.data")
    return [directory / name, directory / f"{name}.data"]
