"""The joint schema head (docs/format.md §4) in numpy float32, for the ONNX Runtime backend (no torch), laid out like
:mod:`clef_local.heads.torch_head`. GELU is ``nn.GELU()``'s exact erf form; numpy has no ``erf``, so :func:`_erf` is
W. J. Cody's rational approximation in float64, float32-exact once rounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from clef_local.errors import ReleaseError
from clef_local.formats.head_config import HeadConfig
from clef_local.formats.safetensors import read_numpy
from clef_local.runtime.layout import HeadLayout

_MAX_LOG_SCALE = math.log(100.0)  # exp(scale) is clamped at 100 (docs/format.md §4, step 7)
_LN_EPS = 1e-5  # torch.nn.LayerNorm's default
Params = dict[str, np.ndarray]


def _erf(x: np.ndarray) -> np.ndarray:
    """erf in float64 (Cody's rational approximations on |x| < 0.5, < 4, ≥ 4)."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    out = np.empty_like(a)
    small = a < 0.5
    z = a[small] ** 2
    p = (((1.857777061846031526730e-1 * z + 3.161123743870565596947e0) * z + 1.138641541510501556495e2) * z
         + 3.774852376853020208137e2) * z + 3.209377589138469472562e3
    q = (((z + 2.360129095234412093499e1) * z + 2.440246379344441733056e2) * z + 1.282616526077372275645e3) * z \
        + 2.844236833439170622273e3
    out[small] = a[small] * p / q
    mid = (a >= 0.5) & (a < 4.0)
    y = a[mid]
    p = (((((((5.64188496988670089e-1 * y + 8.88314979438837594e0) * y + 6.61191906371416295e1) * y
             + 2.98635138197400131e2) * y + 8.81952221241769090e2) * y + 1.71204761263407058e3) * y
          + 2.05107837782607147e3) * y + 1.23033935479799725e3)
    q = (((((((y + 1.57449261107098347e1) * y + 1.17693950891312499e2) * y + 5.37181101862009858e2) * y
            + 1.62138957456669019e3) * y + 3.29079923573345963e3) * y + 4.36261909014324716e3) * y
         + 3.43936767414372164e3) * y + 1.23033935480374942e3
    out[mid] = 1.0 - np.exp(-y * y) * p / q
    large = a >= 4.0
    y = a[large]
    z = 1.0 / (y * y)
    p = ((((1.63153871373020978e-2 * z + 3.05326634961232344e-1) * z + 3.60344899949804439e-1) * z
          + 1.25781726111229246e-1) * z + 1.60837851487422766e-2) * z + 6.58749161529837803e-4
    q = ((((z + 2.56852019228982242e0) * z + 1.87295284992346725e0) * z + 5.27905102951428412e-1) * z
         + 6.05183413124413191e-2) * z + 2.33520497626869185e-3
    out[large] = 1.0 - np.exp(-y * y) / y * (1.0 / math.sqrt(math.pi) - z * p / q)
    return np.copysign(out, x)


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact GELU ``x · Φ(x)`` (``nn.GELU()``), float32 in, float32 out."""
    return (0.5 * x.astype(np.float64) * (1.0 + _erf(x / math.sqrt(2.0)))).astype(np.float32)


def layer_norm(x: np.ndarray, p: Params, name: str) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + _LN_EPS) * p[f"{name}.weight"] + p[f"{name}.bias"]


def linear(x: np.ndarray, p: Params, name: str) -> np.ndarray:
    y = x @ p[f"{name}.weight"].T
    bias = p.get(f"{name}.bias")
    return y if bias is None else y + bias


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def span_mean(values: np.ndarray, index: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Row ``s`` = mean of ``values[index[offsets[s]:offsets[s + 1]]]`` (every span non-empty by construction)."""
    sums = np.add.reduceat(values[index], offsets[:-1], axis=0)
    return sums / np.diff(offsets).astype(values.dtype)[:, None]


def scatter_padded(rows: np.ndarray, group: np.ndarray, slot: np.ndarray, groups: int, width: int) -> np.ndarray:
    out = np.zeros((groups, width, rows.shape[-1]), dtype=rows.dtype)
    out[group, slot] = rows
    return out


def padded_logits(values: np.ndarray, layout: HeadLayout) -> np.ndarray:
    """Per-option values ``[O]`` laid out ``[questions, max_options]``, ``-inf`` where a question has fewer."""
    out = np.full((layout.num_questions, layout.max_options), -np.inf, dtype=np.float32)
    out[layout.option_question, layout.option_slot] = values
    return out


def attend(p: Params, name: str, heads: int, query: np.ndarray, memory: np.ndarray, key_pad: np.ndarray | None,
           self_attention: bool = False) -> np.ndarray:
    """``nn.MultiheadAttention`` (batch_first, inference) with a key padding mask (True = padding)."""
    weight, bias = p[f"{name}.in_proj_weight"], p[f"{name}.in_proj_bias"]
    width = weight.shape[1]
    if self_attention:
        q, k, v = np.split(query @ weight.T + bias, 3, axis=-1)
    else:
        q = query @ weight[:width].T + bias[:width]
        k, v = np.split(memory @ weight[width:].T + bias[width:], 2, axis=-1)

    def split(x: np.ndarray) -> np.ndarray:
        return x.reshape(*x.shape[:-1], heads, width // heads).transpose(0, 2, 1, 3)

    scores = split(q) @ split(k).transpose(0, 1, 3, 2) / np.float32(math.sqrt(width // heads))
    if key_pad is not None:
        scores = np.where(key_pad[:, None, None, :], np.float32(-np.inf), scores)
    out = softmax(scores) @ split(v)
    out = out.transpose(0, 2, 1, 3).reshape(*query.shape[:-1], width)
    return linear(out, p, f"{name}.out_proj")


def routing_layer(p: Params, name: str, heads: int, queries: np.ndarray, memory: np.ndarray,
                  memory_pad: np.ndarray | None) -> np.ndarray:
    """One evidence-routing layer: option queries attend to the memory, then a feed-forward block."""
    normed_memory = layer_norm(memory, p, f"{name}.memory_norm")
    queries = queries + attend(p, f"{name}.attention", heads, layer_norm(queries, p, f"{name}.query_norm"),
                               normed_memory, memory_pad)
    ff = gelu(linear(layer_norm(queries, p, f"{name}.feedforward_norm"), p, f"{name}.feedforward.0"))
    return queries + linear(ff, p, f"{name}.feedforward.3")


def decoder_layer(p: Params, name: str, heads: int, x: np.ndarray, memory: np.ndarray,
                  field_pad: np.ndarray | None, memory_pad: np.ndarray | None) -> np.ndarray:
    """``nn.TransformerDecoderLayer(norm_first=True, activation="gelu")`` at inference."""
    h = layer_norm(x, p, f"{name}.norm1")
    x = x + attend(p, f"{name}.self_attn", heads, h, h, field_pad, self_attention=True)
    x = x + attend(p, f"{name}.multihead_attn", heads, layer_norm(x, p, f"{name}.norm2"), memory, memory_pad)
    return x + linear(gelu(linear(layer_norm(x, p, f"{name}.norm3"), p, f"{name}.linear1")), p, f"{name}.linear2")


def score_options(p: Params, field_of_option: np.ndarray, options: np.ndarray) -> np.ndarray:
    """The gated joint score of every option, without the lexical prior (docs/format.md §4, step 7)."""
    norms = np.linalg.norm(field_of_option, axis=-1) * np.linalg.norm(options, axis=-1)
    cosine = (field_of_option * options).sum(-1) / np.maximum(norms, 1e-8)
    features = np.concatenate([field_of_option, options, field_of_option * options,
                               np.abs(field_of_option - options)], axis=-1)
    residual = linear(gelu(linear(features, p, "residual_scorer.0")), p, "residual_scorer.3")[:, 0]
    joint = np.exp(min(float(p["joint_logit_scale"]), _MAX_LOG_SCALE)) * cosine + residual
    gate = 1.0 / (1.0 + math.exp(-float(p["residual_gate"])))
    return gate * joint


@dataclass(frozen=True)
class HeadInputs:
    """What the head reads of a batch's backbone pass (docs/format.md §4, steps 1-2), after ``hidden_norm``."""

    hidden: np.ndarray  # [B, T, hidden]
    memory_pad: np.ndarray | None  # [B, T], True on padding; None when nothing is padded
    question: np.ndarray  # [Q, hidden] question-span means
    option_context: np.ndarray  # [O, hidden] option-span means
    option_lexical: np.ndarray  # [O, hidden] the option spans' mean output-embedding rows
    last: np.ndarray  # [B, hidden] each record's last real token


class NumpyHead:
    """The release's joint schema head in numpy float32: ``head(hidden, mask, lexical, layout)`` → ``[Q, K]``."""

    def __init__(self, config: HeadConfig, params: Params) -> None:
        self.config = config
        self.p = {k: np.asarray(v, dtype=np.float32, order="C") for k, v in params.items()}
        for name in ("prior_logit_scale", "joint_logit_scale", "residual_gate", "hidden_norm.weight",
                     "memory_projection.weight", "type_embedding.weight", "field_norm.weight"):
            if name not in self.p:
                raise ReleaseError(f"joint_head.safetensors has no tensor {name}; it is not a joint schema head")

    def __call__(self, hidden_states: np.ndarray, attention_mask: np.ndarray, lexical_rows: np.ndarray,
                 layout: HeadLayout) -> np.ndarray:
        """Option logits ``[questions, max_options]`` (``-inf`` padding) from ``[B, T, hidden]`` hidden states,
        the ``[B, T]`` mask and the output-embedding rows of ``layout.option_token_ids``."""
        return self.logits(self.read(hidden_states, attention_mask, lexical_rows, layout), layout)

    def read(self, hidden_states: np.ndarray, attention_mask: np.ndarray, lexical_rows: np.ndarray,
             layout: HeadLayout) -> HeadInputs:
        hidden = layer_norm(hidden_states.astype(np.float32, copy=False), self.p, "hidden_norm")
        flat = hidden.reshape(-1, hidden.shape[-1])
        lexical = lexical_rows.astype(np.float32, copy=False)
        return HeadInputs(
            hidden=hidden,
            memory_pad=None if bool(attention_mask.all()) else attention_mask == 0,
            question=span_mean(flat, layout.question_token_index, layout.question_token_offsets),
            option_context=span_mean(flat, layout.option_token_index, layout.option_token_offsets),
            option_lexical=span_mean(lexical, np.arange(lexical.shape[0]), layout.option_token_offsets),
            last=flat[layout.record_last_index])

    def logits(self, x: HeadInputs, layout: HeadLayout) -> np.ndarray:
        p, heads = self.p, self.config.heads
        batch = x.hidden.shape[0]
        memory = x.hidden @ p["memory_projection.weight"].T
        queries = (x.option_context @ p["option_context_projection.weight"].T
                   + x.option_lexical @ p["option_lexical_projection.weight"].T
                   + (x.question @ p["option_question_projection.weight"].T)[layout.option_question])
        routed = scatter_padded(queries, layout.option_record, layout.option_record_slot, batch,
                                layout.max_options_per_record)
        for i in range(self.config.routing_layers):
            routed = routing_layer(p, f"evidence_layers.{i}", heads, routed, memory, x.memory_pad)
        routed = routed[layout.option_record, layout.option_record_slot]  # [O, w]

        base_fields = x.question @ p["question_projection.weight"].T
        scores = (routed * base_fields[layout.option_question]).sum(-1) / np.float32(math.sqrt(routed.shape[-1]))
        weights = softmax(padded_logits(scores, layout))
        per_question = scatter_padded(routed, layout.option_question, layout.option_slot, layout.num_questions,
                                      layout.max_options)
        summary = np.einsum("qk,qkw->qw", weights, per_question)
        fields = (base_fields + layer_norm(summary, p, "option_summary_norm")
                  + (x.last @ p["global_projection.weight"].T)[layout.question_record]
                  + p["type_embedding.weight"][layout.question_type])

        seq = scatter_padded(fields, layout.question_record, layout.question_slot, batch,
                             layout.max_questions_per_record)
        field_pad = np.ones((batch, layout.max_questions_per_record), dtype=bool)
        field_pad[layout.question_record, layout.question_slot] = False
        pad = field_pad if field_pad.any() else None
        for i in range(self.config.layers):
            seq = decoder_layer(p, f"layers.{i}", heads, seq, memory, pad, x.memory_pad)
        fields = layer_norm(seq[layout.question_record, layout.question_slot], p, "field_norm")

        anchor = normalize(x.question + x.last[layout.question_record])
        prior_scale = np.exp(min(float(p["prior_logit_scale"]), _MAX_LOG_SCALE))
        prior = prior_scale * (normalize(x.option_lexical) * anchor[layout.option_question]).sum(-1)
        options = layer_norm(routed, p, "option_norm")
        logits = prior + score_options(p, fields[layout.option_question], options)
        return padded_logits(logits.astype(np.float32), layout)


def load_head(release: Any) -> NumpyHead:
    """The release's head, its tensor names and shapes checked strictly as the torch head loads them (BF16 widened
    to float32 exactly; numpy only, no ``safetensors`` package)."""
    from clef_local.formats.head_config import head_tensor_shapes
    from clef_local.formats.release import HEAD_WEIGHTS, check_head_tensors

    file = release.path / HEAD_WEIGHTS
    check_head_tensors(file, head_tensor_shapes(release.head_config))
    return NumpyHead(release.head_config, read_numpy(file))
