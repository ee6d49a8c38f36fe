"""Qwen3.5's Gated DeltaNet (linear-attention) layers as ONNX Runtime's ``com.microsoft`` ``GatedDeltaNet`` node.

transformers' PyTorch fallback does not export with a dynamic sequence axis, so during the export only
(:func:`gated_delta_patch`) it becomes a custom op that :data:`TRANSLATION` turns into that node (:data:`SCHEMA`
describes it for the exporter). Why, and the recurrence both compute: docs/hardware.md#onnx-runtime.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

_OP = "clef_onnx::gated_delta_rule"


@torch.library.custom_op(_OP, mutates_args=())
def gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """The gated delta rule on l2-normalised ``query``/``key`` ``[B, S, H, Dk]``, ``value`` ``[B, S, H, Dv]``,
    log-decay ``g`` and ``beta`` ``[B, S, H]`` (float32, zero initial state); returns ``[B, S, H, Dv]``."""
    batch, seq, heads, dk = key.shape
    q = query * dk**-0.5
    state = value.new_zeros(batch, heads, dk, value.shape[-1])
    out = value.new_zeros(value.shape)
    for t in range(seq):
        state = state * g[:, t].exp()[..., None, None]
        delta = (value[:, t] - (state * key[:, t].unsqueeze(-1)).sum(-2)) * beta[:, t].unsqueeze(-1)
        state = state + key[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, t] = (state * q[:, t].unsqueeze(-1)).sum(-2)
    return out


@gated_delta_rule.register_fake
def _fake(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    return value.new_empty(value.shape)


def _export_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64,
                 initial_state: Tensor | None = None, output_final_state: bool = False,
                 use_qk_l2norm_in_kernel: bool = False, **kwargs: Any) -> tuple[Tensor, None]:
    """``torch_chunk_gated_delta_rule``'s signature, for a prefill without cache (what a decision runs)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    if initial_state is not None or output_final_state:
        raise NotImplementedError("the ONNX export runs a prefill without cache (no recurrent state in or out)")
    dtype = query.dtype
    k_heads, v_heads = key.shape[2], value.shape[2]
    if k_heads != v_heads:  # transformers' grouping: value head j reads query/key head j // (v_heads / k_heads)
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value, g, beta = (x.to(torch.float32) for x in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        query = qwen.l2norm(query, dim=-1, eps=1e-6)
        key = qwen.l2norm(key, dim=-1, eps=1e-6)
    return torch.ops.clef_onnx.gated_delta_rule(query, key, value, g, beta).to(dtype), None


@contextlib.contextmanager
def gated_delta_patch() -> Iterator[None]:
    """Within the block, Qwen3.5's linear-attention layers call :func:`gated_delta_rule` (then restored)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    original = qwen.torch_chunk_gated_delta_rule
    qwen.torch_chunk_gated_delta_rule = _export_rule
    try:
        yield
    finally:
        qwen.torch_chunk_gated_delta_rule = original


def _schema() -> Any:
    from onnx.defs import OpSchema

    param, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    inputs = [param("query", "T"), param("key", "T", param_option=optional),
              param("value", "T", param_option=optional), param("cu_seqlens", "TI", param_option=optional),
              param("decay", "T", param_option=optional), param("beta", "T", param_option=optional),
              param("initial_state", "T", param_option=optional)]
    return OpSchema("GatedDeltaNet", "com.microsoft", 1, inputs=inputs,
                    outputs=[param("output", "T"), param("final_state", "T", param_option=optional)],
                    type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("TI", ["tensor(int32)"], "")],
                    attributes=[OpSchema.Attribute("update_rule", OpSchema.AttrType.STRING, "")])


def _translation() -> dict[Any, Any]:
    import onnxscript
    from onnxscript import opset18 as op

    node = onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "GatedDeltaNet", op_schema=_schema())

    def gated_delta_net(query: Any, key: Any, value: Any, g: Any, beta: Any) -> Any:
        shape = op.Shape(value)  # state: [batch, heads, dv, dk] (V-major), zeros
        state_shape = op.Concat(op.Slice(shape, [0], [1]), op.Slice(shape, [2], [4]),
                                op.Slice(op.Shape(key), [3], [4]), axis=0)
        out, _final = node(query, key, value, None, g, beta, op.ConstantOfShape(state_shape),
                           update_rule="gated_delta", _outputs=2)
        return out

    return {torch.ops.clef_onnx.gated_delta_rule.default: gated_delta_net}


TRANSLATION = _translation()
