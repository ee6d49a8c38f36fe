"""The joint schema head (docs/format.md §4) in MLX float32: the MLX backend's head. Laid out like
:mod:`clef_local.heads.torch_head` (the same steps under the same names); ``tests/test_heads.py`` holds the three
engines to the same numbers. Weights come from ``joint_head.safetensors``, loaded strictly; torch is never imported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
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
Params = Mapping[str, mx.array]


def load_head_weights(file: Path, config: HeadConfig) -> dict[str, mx.array]:
    """``joint_head.safetensors`` as float32 MLX arrays, after checking every name and shape against ``config``."""
    from clef_local.formats.release import check_head_tensors
    from clef_local.formats.safetensors import read_numpy

    check_head_tensors(file, head_tensor_shapes(config))
    return {name: mx.array(np.asarray(t, dtype=np.float32)) for name, t in read_numpy(file).items()}


def linear(x: mx.array, p: Params, name: str) -> mx.array:
    out = x @ p[f"{name}.weight"].T
    bias = p.get(f"{name}.bias")
    return out if bias is None else out + bias


def layer_norm(x: mx.array, p: Params, name: str) -> mx.array:
    return mx.fast.layer_norm(x, p[f"{name}.weight"], p[f"{name}.bias"], _LN_EPS)


def normalize(x: mx.array, eps: float) -> mx.array:
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), eps)


def span_mean(values: mx.array, index: np.ndarray, offsets: np.ndarray) -> mx.array:
    """Mean of ``values`` rows over each span (CSR ``offsets`` into ``index``); every span is non-empty."""
    lengths = np.diff(offsets)
    segment = mx.array(np.repeat(np.arange(len(lengths), dtype=np.int32), lengths))
    rows = values[mx.array(np.asarray(index, dtype=np.int32))]
    sums = mx.zeros((len(lengths), values.shape[-1]), dtype=values.dtype).at[segment].add(rows)
    return sums / mx.array(lengths.astype(np.float32))[:, None]


class Gather:
    """Where each row of a flat ``[N, w]`` tensor goes in a padded ``[groups, width, w]`` one (built in numpy)."""

    def __init__(self, group: np.ndarray, slot: np.ndarray, groups: int, width: int) -> None:
        cells = np.asarray(group) * width + np.asarray(slot)
        src = np.zeros(groups * width, dtype=np.int32)
        valid = np.zeros(groups * width, dtype=bool)
        src[cells] = np.arange(len(cells), dtype=np.int32)
        valid[cells] = True
        self.src, self.valid, self.groups, self.width = mx.array(src), mx.array(valid), groups, width
        self.back = mx.array(cells.astype(np.int32))  # padded cell of each flat row

    def padded(self, rows: mx.array) -> mx.array:
        return mx.where(self.valid[:, None], rows[self.src], 0.0).reshape(self.groups, self.width, rows.shape[-1])

    def flat(self, padded: mx.array) -> mx.array:
        return padded.reshape(-1, padded.shape[-1])[self.back]


def padded_logits(values: mx.array, per_question: Gather) -> mx.array:
    """Per-option values ``[O]`` laid out ``[questions, max_options]``, ``-inf`` where a question has fewer."""
    return mx.where(per_question.valid, values[per_question.src], -mx.inf).reshape(per_question.groups,
                                                                                   per_question.width)


def attend(p: Params, name: str, heads: int, query: mx.array, memory: mx.array, keep: mx.array | None,
           self_attention: bool = False) -> mx.array:
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


def routing_layer(p: Params, name: str, heads: int, queries: mx.array, memory: mx.array,
                  keep: mx.array | None) -> mx.array:
    """One evidence-routing layer: option queries attend to the memory, then a feed-forward block."""
    normed_memory = layer_norm(memory, p, f"{name}.memory_norm")
    queries = queries + attend(p, f"{name}.attention", heads, layer_norm(queries, p, f"{name}.query_norm"),
                               normed_memory, keep)
    ff = nn.gelu(linear(layer_norm(queries, p, f"{name}.feedforward_norm"), p, f"{name}.feedforward.0"))
    return queries + linear(ff, p, f"{name}.feedforward.3")


def decoder_layer(p: Params, name: str, heads: int, x: mx.array, memory: mx.array, field_keep: mx.array | None,
                  keep: mx.array | None) -> mx.array:
    """``nn.TransformerDecoderLayer(norm_first=True, activation="gelu")`` at inference."""
    h = layer_norm(x, p, f"{name}.norm1")
    x = x + attend(p, f"{name}.self_attn", heads, h, h, field_keep, self_attention=True)
    x = x + attend(p, f"{name}.multihead_attn", heads, layer_norm(x, p, f"{name}.norm2"), memory, keep)
    return x + linear(nn.gelu(linear(layer_norm(x, p, f"{name}.norm3"), p, f"{name}.linear1")), p,
                      f"{name}.linear2")


def score_options(p: Params, field_of_option: mx.array, options: mx.array) -> mx.array:
    """The gated joint score of every option, without the lexical prior (docs/format.md §4, step 7)."""
    cosine = (normalize(field_of_option, _COSINE_EPS) * normalize(options, _COSINE_EPS)).sum(-1)
    features = mx.concatenate([field_of_option, options, field_of_option * options,
                               mx.abs(field_of_option - options)], axis=-1)
    residual = linear(nn.gelu(linear(features, p, "residual_scorer.0")), p, "residual_scorer.3")[:, 0]
    joint = mx.exp(mx.minimum(p["joint_logit_scale"], _MAX_LOG_SCALE)) * cosine + residual
    return mx.sigmoid(p["residual_gate"]) * joint


@dataclass(frozen=True)
class HeadInputs:
    """What the head reads of a batch's backbone pass (docs/format.md §4, steps 1-2), after ``hidden_norm``."""

    hidden: mx.array  # [B, T, hidden]
    keep: mx.array | None  # [B, 1, 1, T], True on real tokens; None when nothing is padded
    question: mx.array  # [Q, hidden] question-span means
    option_context: mx.array  # [O, hidden] option-span means
    option_lexical: mx.array  # [O, hidden] the option spans' mean output-embedding rows
    last: mx.array  # [B, hidden] each record's last real token


class MLXJointSchemaHead:
    """docs/format.md §4 on MLX arrays: ``head(hidden, mask, lexical, layout)`` → ``[Q, K]`` logits."""

    def __init__(self, config: HeadConfig, weights: Params) -> None:
        self.config = config
        self.p = dict(weights)

    @property
    def parameters(self) -> int:
        return sum(int(v.size) for v in self.p.values())

    def __call__(self, hidden_states: mx.array, attention_mask: np.ndarray, lexical_rows: mx.array,
                 layout: HeadLayout) -> mx.array:
        """Logits ``[questions, max_options]`` (``-inf`` padding) from right-padded ``hidden_states`` [B, T, h],
        their ``[B, T]`` mask and ``lexical_rows`` = output-embedding rows of ``layout.option_token_ids``."""
        return self.logits(self.read(hidden_states, attention_mask, lexical_rows, layout), layout)

    def read(self, hidden_states: mx.array, attention_mask: np.ndarray, lexical_rows: mx.array,
             layout: HeadLayout) -> HeadInputs:
        hidden = layer_norm(hidden_states.astype(mx.float32), self.p, "hidden_norm")
        flat = hidden.reshape(-1, hidden.shape[-1])
        mask = np.asarray(attention_mask, dtype=bool)
        keep = None if mask.all() else mx.array(mask)[:, None, None, :]
        lexical = lexical_rows.astype(mx.float32)
        return HeadInputs(
            hidden=hidden, keep=keep,
            question=span_mean(flat, layout.question_token_index, layout.question_token_offsets),
            option_context=span_mean(flat, layout.option_token_index, layout.option_token_offsets),
            option_lexical=span_mean(lexical, np.arange(lexical.shape[0]), layout.option_token_offsets),
            last=flat[mx.array(np.asarray(layout.record_last_index, dtype=np.int32))])

    def logits(self, x: HeadInputs, layout: HeadLayout) -> mx.array:
        p, heads = self.p, self.config.heads
        batch = x.hidden.shape[0]
        option_question = mx.array(np.asarray(layout.option_question, dtype=np.int32))
        question_record = mx.array(np.asarray(layout.question_record, dtype=np.int32))
        per_record = Gather(layout.option_record, layout.option_record_slot, batch, layout.max_options_per_record)
        per_question = Gather(layout.option_question, layout.option_slot, layout.num_questions, layout.max_options)
        fields_of_record = Gather(layout.question_record, layout.question_slot, batch,
                                  layout.max_questions_per_record)
        memory = x.hidden @ p["memory_projection.weight"].T

        queries = (x.option_context @ p["option_context_projection.weight"].T
                   + x.option_lexical @ p["option_lexical_projection.weight"].T
                   + (x.question @ p["option_question_projection.weight"].T)[option_question])
        routed = per_record.padded(queries)
        for i in range(self.config.routing_layers):
            routed = routing_layer(p, f"evidence_layers.{i}", heads, routed, memory, x.keep)
        routed = per_record.flat(routed)  # [O, w]

        base_fields = x.question @ p["question_projection.weight"].T  # [Q, w]
        scores = (routed * base_fields[option_question]).sum(-1) / math.sqrt(routed.shape[-1])
        weights = mx.softmax(padded_logits(scores, per_question), axis=-1)  # [Q, K]
        summary = (weights[..., None] * per_question.padded(routed)).sum(axis=1)
        fields = (base_fields + layer_norm(summary, p, "option_summary_norm")
                  + (x.last @ p["global_projection.weight"].T)[question_record]
                  + p["type_embedding.weight"][mx.array(np.asarray(layout.question_type, dtype=np.int32))])

        seq = fields_of_record.padded(fields)
        field_keep = None
        if not bool(np.asarray(fields_of_record.valid).all()):
            field_keep = fields_of_record.valid.reshape(batch, 1, 1, -1)
        for i in range(self.config.layers):
            seq = decoder_layer(p, f"layers.{i}", heads, seq, memory, field_keep, x.keep)
        fields = layer_norm(fields_of_record.flat(seq), p, "field_norm")  # [Q, w]

        anchor = normalize(x.question + x.last[question_record], _NORMALIZE_EPS)
        prior_scale = mx.exp(mx.minimum(p["prior_logit_scale"], _MAX_LOG_SCALE))
        prior = prior_scale * (normalize(x.option_lexical, _NORMALIZE_EPS) * anchor[option_question]).sum(-1)
        options = layer_norm(routed, p, "option_norm")
        logits = prior + score_options(p, fields[option_question], options)  # [O]
        return padded_logits(logits, per_question)


def load_head(release: Any) -> MLXJointSchemaHead:
    """The release's head as float32 MLX arrays, loaded strictly."""
    from clef_local.formats.release import HEAD_WEIGHTS

    return MLXJointSchemaHead(release.head_config, load_head_weights(release.path / HEAD_WEIGHTS,
                                                                     release.head_config))
