"""The joint schema head (docs/format.md §4) in MLX, float32, batched exactly like :mod:`clef_local.runtime.head`.

Same math and the same batching as the torch head: span means by segment sums, option queries padded per record
for the evidence-routing cross-attention (padding keys of the memory masked), a masked softmax per question for the
option summary, the field transformer (``nn.TransformerDecoderLayer``, ``norm_first=True``, GELU, eval mode: no
dropout) over each record's questions, then prior + gated joint scores. Weights come from
``joint_head.safetensors``, loaded strictly: every name of the release's state dict with its exact shape, nothing
else (:func:`clef_local.formats.head_config.head_tensor_shapes`). Torch is never imported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from clef_local.formats.head_config import HeadConfig, head_tensor_shapes
from clef_local.runtime.layout import HeadLayout

_MAX_LOG_SCALE = math.log(100.0)  # exp(scale) is clamped at 100 (docs/format.md §4, step 7)
_LN_EPS = 1e-5  # torch.nn.LayerNorm's default
_NORMALIZE_EPS = 1e-12  # F.normalize
_COSINE_EPS = 1e-8  # F.cosine_similarity


def load_head_weights(file: Path, config: HeadConfig) -> dict[str, mx.array]:
    """``joint_head.safetensors`` as float32 MLX arrays, after checking every name and shape against ``config``."""
    from clef_local.backends.mlx_weights import read_safetensors
    from clef_local.formats.release import check_head_tensors

    check_head_tensors(file, head_tensor_shapes(config))
    return {name: mx.array(t.float32()) for name, t in read_safetensors(file).items()}


def _linear(x: mx.array, p: Mapping[str, mx.array], name: str) -> mx.array:
    out = x @ p[f"{name}.weight"].T
    bias = p.get(f"{name}.bias")
    return out if bias is None else out + bias


def _norm(x: mx.array, p: Mapping[str, mx.array], name: str) -> mx.array:
    return mx.fast.layer_norm(x, p[f"{name}.weight"], p[f"{name}.bias"], _LN_EPS)


def _attend(p: Mapping[str, mx.array], name: str, heads: int, query: mx.array, memory: mx.array,
            keep: mx.array | None, self_attention: bool = False) -> mx.array:
    """``nn.MultiheadAttention`` (batch_first, eval): ``keep`` [B, 1, 1, S] is True on keys that may be attended."""
    weight, bias = p[f"{name}.in_proj_weight"], p[f"{name}.in_proj_bias"]
    width = weight.shape[1]
    if self_attention:
        q, k, v = mx.split(query @ weight.T + bias, 3, axis=-1)
    else:
        q = query @ weight[:width].T + bias[:width]
        k, v = mx.split(memory @ weight[width:].T + bias[width:], 2, axis=-1)

    def split(x: mx.array) -> mx.array:
        return x.reshape(x.shape[0], x.shape[1], heads, width // heads).transpose(0, 2, 1, 3)

    out = mx.fast.scaled_dot_product_attention(split(q), split(k), split(v), scale=(width // heads) ** -0.5,
                                               mask=keep)
    out = out.transpose(0, 2, 1, 3).reshape(query.shape[0], query.shape[1], width)
    return out @ p[f"{name}.out_proj.weight"].T + p[f"{name}.out_proj.bias"]


def _normalize(x: mx.array, eps: float) -> mx.array:
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), eps)


class _Indices:
    """The layout's index arrays as MLX arrays, plus gather maps for the padded tensors (built once in numpy)."""

    def __init__(self, layout: HeadLayout, batch: int) -> None:
        self.layout = layout

        def arr(a: np.ndarray) -> mx.array:
            return mx.array(np.asarray(a, dtype=np.int32))

        self.option_question = arr(layout.option_question)
        self.question_record = arr(layout.question_record)
        self.question_type = arr(layout.question_type)
        self.record_last = arr(layout.record_last_index)
        self.routed_pad = self._gather_map(layout.option_record, layout.option_record_slot, batch,
                                           layout.max_options_per_record)
        self.routed_back = arr(layout.option_record * layout.max_options_per_record + layout.option_record_slot)
        self.per_question = self._gather_map(layout.option_question, layout.option_slot, layout.num_questions,
                                             layout.max_options)
        self.fields_pad = self._gather_map(layout.question_record, layout.question_slot, batch,
                                           layout.max_questions_per_record)
        self.fields_back = arr(layout.question_record * layout.max_questions_per_record + layout.question_slot)

    def _gather_map(self, group: np.ndarray, slot: np.ndarray, groups: int, width: int) -> tuple[mx.array, ...]:
        """(source row per padded cell, valid mask) so ``rows[src] * valid`` is the padded ``[groups, width]``."""
        src = np.zeros(groups * width, dtype=np.int32)
        valid = np.zeros(groups * width, dtype=bool)
        cells = np.asarray(group) * width + np.asarray(slot)
        src[cells] = np.arange(len(cells), dtype=np.int32)
        valid[cells] = True
        return mx.array(src), mx.array(valid), groups, width


def _padded(rows: mx.array, gather: tuple[Any, ...]) -> mx.array:
    src, valid, groups, width = gather
    return mx.where(valid[:, None], rows[src], 0.0).reshape(groups, width, rows.shape[-1])


def _span_mean(values: mx.array, index: np.ndarray, offsets: np.ndarray) -> mx.array:
    """Mean of ``values`` rows over each span (CSR ``offsets`` into ``index``); every span is non-empty."""
    lengths = np.diff(offsets)
    segment = mx.array(np.repeat(np.arange(len(lengths), dtype=np.int32), lengths))
    rows = values[mx.array(np.asarray(index, dtype=np.int32))]
    sums = mx.zeros((len(lengths), values.shape[-1]), dtype=values.dtype).at[segment].add(rows)
    return sums / mx.array(lengths.astype(np.float32))[:, None]


class MLXJointSchemaHead:
    """docs/format.md §4 on MLX arrays; :meth:`__call__` has the torch head's signature and returns ``[Q, K]``
    logits."""

    def __init__(self, config: HeadConfig, weights: Mapping[str, mx.array]) -> None:
        self.config = config
        self.p = dict(weights)

    @classmethod
    def from_file(cls, file: Path, config: HeadConfig) -> MLXJointSchemaHead:
        return cls(config, load_head_weights(file, config))

    @property
    def parameters(self) -> int:
        return sum(int(v.size) for v in self.p.values())

    def __call__(self, hidden_states: mx.array, lengths: np.ndarray, lexical_rows: mx.array,
                 layout: HeadLayout) -> mx.array:
        """Logits ``[questions, max_options]`` (``-inf`` padding) from right-padded ``hidden_states`` [B, T, h]
        whose records have ``lengths`` real tokens, and ``lexical_rows`` = output-embedding rows of
        ``layout.option_token_ids``."""
        p, heads = self.p, self.config.heads
        hidden = _norm(hidden_states.astype(mx.float32), p, "hidden_norm")
        batch, seq_len, _ = hidden.shape
        flat = hidden.reshape(batch * seq_len, -1)
        memory = hidden @ p["memory_projection.weight"].T
        keep = None
        if int(np.min(lengths)) < seq_len:  # padding keys are masked (the reference sees only real tokens)
            keep = mx.array(np.arange(seq_len)[None, :] < np.asarray(lengths)[:, None])[:, None, None, :]
        ix = _Indices(layout, batch)

        question_vec = _span_mean(flat, layout.question_token_index, layout.question_token_offsets)
        option_ctx = _span_mean(flat, layout.option_token_index, layout.option_token_offsets)
        option_lex = _span_mean(lexical_rows.astype(mx.float32), np.arange(lexical_rows.shape[0]),
                                layout.option_token_offsets)
        global_vec = flat[ix.record_last]

        queries = (option_ctx @ p["option_context_projection.weight"].T
                   + option_lex @ p["option_lexical_projection.weight"].T
                   + (question_vec @ p["option_question_projection.weight"].T)[ix.option_question])
        routed = _padded(queries, ix.routed_pad)
        for i in range(self.config.routing_layers):
            name = f"evidence_layers.{i}"
            normed_memory = _norm(memory, p, f"{name}.memory_norm")
            routed = routed + _attend(p, f"{name}.attention", heads, _norm(routed, p, f"{name}.query_norm"),
                                      normed_memory, keep)
            hidden_ff = nn.gelu(_linear(_norm(routed, p, f"{name}.feedforward_norm"), p, f"{name}.feedforward.0"))
            routed = routed + _linear(hidden_ff, p, f"{name}.feedforward.3")
        routed = routed.reshape(-1, routed.shape[-1])[ix.routed_back]  # [O, w]

        base_fields = question_vec @ p["question_projection.weight"].T  # [Q, w]
        scores = (routed * base_fields[ix.option_question]).sum(-1) / math.sqrt(routed.shape[-1])
        weights = mx.softmax(self._to_padded(scores, ix), axis=-1)  # [Q, K]
        per_question = _padded(routed, ix.per_question)
        summary = (weights[..., None] * per_question).sum(axis=1)
        fields_ = (base_fields + _norm(summary, p, "option_summary_norm")
                   + (global_vec @ p["global_projection.weight"].T)[ix.question_record]
                   + p["type_embedding.weight"][ix.question_type])

        seq = _padded(fields_, ix.fields_pad)
        field_keep = None
        if not bool(np.asarray(ix.fields_pad[1]).all()):
            field_keep = ix.fields_pad[1].reshape(batch, 1, 1, -1)
        for i in range(self.config.layers):
            name = f"layers.{i}"
            h = _norm(seq, p, f"{name}.norm1")
            seq = seq + _attend(p, f"{name}.self_attn", heads, h, h, field_keep, self_attention=True)
            seq = seq + _attend(p, f"{name}.multihead_attn", heads, _norm(seq, p, f"{name}.norm2"), memory, keep)
            seq = seq + _linear(nn.gelu(_linear(_norm(seq, p, f"{name}.norm3"), p, f"{name}.linear1")), p,
                                f"{name}.linear2")
        fields_ = _norm(seq.reshape(-1, seq.shape[-1])[ix.fields_back], p, "field_norm")  # [Q, w]

        anchor = _normalize(question_vec + global_vec[ix.question_record], _NORMALIZE_EPS)
        prior_scale = mx.exp(mx.minimum(p["prior_logit_scale"], _MAX_LOG_SCALE))
        prior = prior_scale * (_normalize(option_lex, _NORMALIZE_EPS) * anchor[ix.option_question]).sum(-1)
        options = _norm(routed, p, "option_norm")
        field_of_option = fields_[ix.option_question]
        cosine = (_normalize(field_of_option, _COSINE_EPS) * _normalize(options, _COSINE_EPS)).sum(-1)
        features = mx.concatenate([field_of_option, options, field_of_option * options,
                                   mx.abs(field_of_option - options)], axis=-1)
        residual = _linear(nn.gelu(_linear(features, p, "residual_scorer.0")), p, "residual_scorer.3")[:, 0]
        joint = mx.exp(mx.minimum(p["joint_logit_scale"], _MAX_LOG_SCALE)) * cosine + residual
        logits = prior + mx.sigmoid(p["residual_gate"]) * joint  # [O]
        return self._to_padded(logits, ix)

    @staticmethod
    def _to_padded(values: mx.array, ix: _Indices) -> mx.array:
        src, valid, groups, width = ix.per_question
        return mx.where(valid, values[src], -mx.inf).reshape(groups, width)
