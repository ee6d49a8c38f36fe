"""The joint schema head (docs/format.md §4) in torch: the torch backend's head and the one training trains.

The reference's per-record loops become batched steps (span means as one sparse matmul, padded option tensors,
masked softmaxes); module names are the release's state-dict names, so ``JointSchemaHead(config).state_dict()`` has
exactly the keys of ``joint_head.safetensors``. :mod:`.mlx_head` and :mod:`.numpy_head` take the same steps.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from clef_local.errors import ReleaseError
from clef_local.formats.head_config import HeadConfig
from clef_local.formats.release import HEAD_WEIGHTS, Release, check_head_tensors
from clef_local.runtime.layout import HeadLayout

__all__ = ["HeadConfig", "HeadInputs", "JointSchemaHead", "load_head", "padded_logits"]

# Span means use a CSR matmul (much faster than index_add_ on a CPU); torch's "beta" notice about it is noise here.
# It is filtered around the op only, never in the process's filters; torch gives it once per process, so after the
# first CSR tensor the op runs without catch_warnings (whose every use re-arms Python's once-per-place warnings).
_CSR_NOTICES = ("Sparse CSR tensor support is in beta", "Sparse invariant checks are implicitly disabled")
_csr_noticed = False

# exp(scale) is clamped at 100 in the release math (docs/format.md §4, step 7).
_MAX_LOG_SCALE = math.log(100.0)


@dataclass(frozen=True)
class HeadInputs:
    """What the head reads of a batch's backbone pass (docs/format.md §4, steps 1-2), after ``hidden_norm``."""

    hidden: torch.Tensor  # [B, T, hidden]
    memory_pad: torch.Tensor | None  # [B, T], True on padding; None when nothing is padded
    question: torch.Tensor  # [Q, hidden] question-span means
    option_context: torch.Tensor  # [O, hidden] option-span means
    option_lexical: torch.Tensor  # [O, hidden] the option spans' mean output-embedding rows
    last: torch.Tensor  # [B, hidden] each record's last real token


class EvidenceRoutingLayer(nn.Module):
    """Option queries attend to the record's memory (cross-attention only), then a feed-forward block."""

    def __init__(self, width: int, heads: int, feedforward: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.query_norm = nn.LayerNorm(width)
        self.memory_norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.attention_dropout = nn.Dropout(dropout)
        self.feedforward_norm = nn.LayerNorm(width)
        # Indices 0 and 3 are the release's names (feedforward.0 / feedforward.3).
        self.feedforward = nn.Sequential(
            nn.Linear(width, feedforward),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(feedforward, width),
            nn.Dropout(dropout),
        )

    def forward(self, queries: torch.Tensor, memory: torch.Tensor, memory_pad: torch.Tensor | None,
                attention: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``attention``, when given, receives this layer's head-averaged attention weights ``[B, K, T]``."""
        normed_memory = self.memory_norm(memory)
        if self.training or attention is not None:
            routed, weights = self.attention(self.query_norm(queries), normed_memory, normed_memory,
                                             key_padding_mask=memory_pad, need_weights=attention is not None,
                                             average_attn_weights=True)
            if attention is not None:
                attention.append(weights)
        else:
            routed = attend(self.attention, self.query_norm(queries), normed_memory, memory_pad)
        queries = queries + self.attention_dropout(routed)
        return queries + self.feedforward(self.feedforward_norm(queries))


class JointSchemaHead(nn.Module):
    """docs/format.md §4 with the release's parameter names; ``forward`` is batched (see :class:`HeadLayout`)."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        h, w, f = config.hidden_size, config.width, config.feedforward
        self.hidden_norm = nn.LayerNorm(h)
        self.memory_projection = nn.Linear(h, w, bias=False)
        self.question_projection = nn.Linear(h, w, bias=False)
        self.option_question_projection = nn.Linear(h, w, bias=False)
        self.global_projection = nn.Linear(h, w, bias=False)
        self.option_context_projection = nn.Linear(h, w, bias=False)
        self.option_lexical_projection = nn.Linear(h, w, bias=False)
        self.type_embedding = nn.Embedding(3, w)
        self.evidence_layers = nn.ModuleList(
            EvidenceRoutingLayer(w, config.heads, f, config.dropout) for _ in range(config.routing_layers)
        )
        self.option_summary_norm = nn.LayerNorm(w)
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(
                d_model=w,
                nhead=config.heads,
                dim_feedforward=f,
                dropout=config.dropout,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(config.layers)
        )
        self.field_norm = nn.LayerNorm(w)
        self.option_norm = nn.LayerNorm(w)
        self.residual_scorer = nn.Sequential(
            nn.Linear(4 * w, w),
            nn.GELU(),
            nn.Dropout(config.dropout),
            nn.Linear(w, 1),
        )
        self.prior_logit_scale = nn.Parameter(torch.zeros(()))
        self.joint_logit_scale = nn.Parameter(torch.zeros(()))
        self.residual_gate = nn.Parameter(torch.zeros(()))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, lexical_rows: torch.Tensor,
                layout: HeadLayout) -> torch.Tensor:
        """Logits of every option, shape ``[questions, max_options]`` (padding is ``-inf``).

        ``hidden_states``: ``[B, T, hidden]`` final hidden states (right-padded); ``attention_mask``: ``[B, T]``;
        ``lexical_rows``: ``[N, hidden]``, the output-embedding rows of ``layout.option_token_ids`` (gathered by
        the caller, so the full ``lm_head`` matrix can stay wherever it lives).
        """
        return self.logits(self.read(hidden_states, attention_mask, lexical_rows, layout), layout)

    def read(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, lexical_rows: torch.Tensor,
             layout: HeadLayout) -> HeadInputs:
        """What the head reads of the backbone pass (docs/format.md §4, steps 1-2): the normed hidden states and
        the span means. Training builds :class:`HeadInputs` from cached span means instead."""
        dtype = self.hidden_norm.weight.dtype
        hidden = self.hidden_norm(hidden_states.to(dtype))
        flat = hidden.reshape(-1, hidden.shape[-1])
        lexical_index = torch.arange(lexical_rows.shape[0], device=lexical_rows.device)
        return HeadInputs(
            hidden=hidden,
            # no mask at all when nothing is padded: attention then takes its fastest kernel
            memory_pad=None if bool(attention_mask.all()) else attention_mask == 0,
            question=span_mean(flat, layout.question_token_index, layout.question_token_offsets),
            option_context=span_mean(flat, layout.option_token_index, layout.option_token_offsets),
            option_lexical=span_mean(lexical_rows.to(dtype), lexical_index, layout.option_token_offsets),
            last=flat[layout.record_last_index])

    def logits(self, x: HeadInputs, layout: HeadLayout, *,
               routing_attention: list[torch.Tensor] | None = None) -> torch.Tensor:
        """docs/format.md §4, steps 3-7: option queries routed over the memory, the option summary, the field
        transformer, the prior and the joint score; ``[questions, max_options]`` logits (``-inf`` padding).
        ``routing_attention`` receives each routing layer's attention weights ``[B, K, T]`` (training)."""
        batch = x.hidden.shape[0]
        memory = self.memory_projection(x.hidden)
        queries = (
            self.option_context_projection(x.option_context)
            + self.option_lexical_projection(x.option_lexical)
            + self.option_question_projection(x.question)[layout.option_question]
        )
        routed = scatter_padded(queries, layout.option_record, layout.option_record_slot, batch,
                                 layout.max_options_per_record)
        for layer in self.evidence_layers:
            routed = layer(routed, memory, x.memory_pad, routing_attention)
        routed = routed[layout.option_record, layout.option_record_slot]  # [O, w]

        # Option summary per question: softmax over its options of u·f/√w.
        base_fields = self.question_projection(x.question)  # [Q, w]
        scores = (routed * base_fields[layout.option_question]).sum(-1) / math.sqrt(routed.shape[-1])
        weights = _padded_softmax(scores, layout)  # [Q, K]
        per_question = scatter_padded(routed, layout.option_question, layout.option_slot,
                                       layout.num_questions, layout.max_options)
        summary = torch.einsum("qk,qkw->qw", weights, per_question)
        fields_ = (
            base_fields
            + self.option_summary_norm(summary)
            + self.global_projection(x.last)[layout.question_record]
            + self.type_embedding(layout.question_type)
        )

        # Field transformer: each record's questions as one sequence, memory as cross-attention input.
        seq = scatter_padded(fields_, layout.question_record, layout.question_slot, batch,
                              layout.max_questions_per_record)
        field_pad = _padding_mask(layout.question_record, layout.question_slot, batch,
                                  layout.max_questions_per_record)
        if not field_pad.any():
            field_pad = None
        for layer in self.layers:
            if self.training:
                seq = layer(seq, memory, tgt_key_padding_mask=field_pad, memory_key_padding_mask=x.memory_pad)
            else:
                seq = decoder_layer(layer, seq, memory, field_pad, x.memory_pad)
        fields_ = self.field_norm(seq[layout.question_record, layout.question_slot])  # [Q, w]

        # Option logits.
        anchor = F.normalize(x.question + x.last[layout.question_record], dim=-1)
        prior_scale = self.prior_logit_scale.clamp(max=_MAX_LOG_SCALE).exp()
        prior = prior_scale * (F.normalize(x.option_lexical, dim=-1) * anchor[layout.option_question]).sum(-1)
        options = self.option_norm(routed)
        logits = prior + self.score_options(fields_[layout.option_question], options)  # [O]
        return _to_padded(logits, layout)

    def score_options(self, field_of_option: torch.Tensor, options: torch.Tensor) -> torch.Tensor:
        """The joint score of every option, ``[O]``, without the lexical prior (docs/format.md §4, step 7)::

            sigmoid(residual_gate) · (exp(joint_logit_scale) · cos(F, o) + residual_scorer([F, o, F·o, |F−o|]))

        ``field_of_option``: ``[O, w]``, each option's question field (after ``field_norm``); ``options``: ``[O, w]``,
        the option vectors (after ``option_norm``); :meth:`logits` adds the prior.
        """
        cosine = F.cosine_similarity(field_of_option, options, dim=-1)
        features = torch.cat(
            [field_of_option, options, field_of_option * options, (field_of_option - options).abs()], dim=-1
        )
        residual = self.residual_scorer(features).squeeze(-1)
        joint = self.joint_logit_scale.clamp(max=_MAX_LOG_SCALE).exp() * cosine + residual
        return torch.sigmoid(self.residual_gate) * joint


def padded_logits(option_values: torch.Tensor, option_question: torch.Tensor, option_slot: torch.Tensor,
                  num_questions: int, max_options: int) -> torch.Tensor:
    """Per-option values ``[O]`` laid out per question, ``[num_questions, max_options]``: option ``n`` at
    ``(option_question[n], option_slot[n])``, ``-inf`` where a question has fewer options (softmax gives them 0)."""
    out = option_values.new_full((num_questions, max_options), float("-inf"))
    out[option_question, option_slot] = option_values
    return out


def attend(attention: nn.MultiheadAttention, query: torch.Tensor, memory: torch.Tensor,
            key_pad: torch.Tensor | None, self_attention: bool = False) -> torch.Tensor:
    """``nn.MultiheadAttention`` at inference (batch_first, no dropout), as a few fused ops: the module's own
    parameters, one projection for K and V (or Q, K and V), and ``scaled_dot_product_attention``. The module's
    generic path costs more in argument checks than the math at head sizes."""
    width, heads = attention.embed_dim, attention.num_heads
    weight, bias = attention.in_proj_weight, attention.in_proj_bias
    if self_attention:
        q, k, v = F.linear(query, weight, bias).chunk(3, dim=-1)
    else:
        q = F.linear(query, weight[:width], bias[:width])
        k, v = F.linear(memory, weight[width:], bias[width:]).chunk(2, dim=-1)

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (heads, width // heads)).transpose(1, 2)

    mask = None if key_pad is None else ~key_pad[:, None, None, :]
    out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
    return F.linear(out.transpose(1, 2).flatten(2), attention.out_proj.weight, attention.out_proj.bias)


def decoder_layer(layer: nn.TransformerDecoderLayer, x: torch.Tensor, memory: torch.Tensor,
                   field_pad: torch.Tensor | None, memory_pad: torch.Tensor | None) -> torch.Tensor:
    """``nn.TransformerDecoderLayer(norm_first=True, activation="gelu")`` at inference, with :func:`attend`."""
    h = layer.norm1(x)
    x = x + attend(layer.self_attn, h, h, field_pad, self_attention=True)
    x = x + attend(layer.multihead_attn, layer.norm2(x), memory, memory_pad)
    return x + layer.linear2(F.gelu(layer.linear1(layer.norm3(x))))


def span_mean(values: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` rows over each span: row ``s`` averages ``values[index[offsets[s]:offsets[s + 1]]]``.

    One CSR matrix of weights ``1/len`` times ``values``; every span is non-empty by construction.
    """
    lengths = offsets.diff()
    weights = (1.0 / lengths.to(values.dtype)).repeat_interleave(lengths)
    matrix = _csr_matrix(offsets, index, weights, (lengths.shape[0], values.shape[0]))
    with torch.autocast(values.device.type, enabled=False):  # no bf16 sparse matmul on CPU; means stay exact
        return matrix @ values


def _csr_matrix(offsets: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, size: tuple[int, int]
                ) -> torch.Tensor:
    """``torch.sparse_csr_tensor`` without its beta notice (see ``_CSR_NOTICES``), leaving the warning filters as
    they were."""
    global _csr_noticed
    if _csr_noticed and not torch.is_warn_always_enabled():
        return torch.sparse_csr_tensor(offsets, index, weights, size=size, check_invariants=False)
    with warnings.catch_warnings():
        for message in _CSR_NOTICES:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        matrix = torch.sparse_csr_tensor(offsets, index, weights, size=size, check_invariants=False)
    _csr_noticed = True
    return matrix


def scatter_padded(
    rows: torch.Tensor, group: torch.Tensor, slot: torch.Tensor, num_groups: int, width: int
) -> torch.Tensor:
    out = rows.new_zeros(num_groups, width, rows.shape[-1])
    out[group, slot] = rows
    return out


def _padding_mask(group: torch.Tensor, slot: torch.Tensor, num_groups: int, width: int) -> torch.Tensor:
    pad = torch.ones(num_groups, width, dtype=torch.bool, device=group.device)
    pad[group, slot] = False
    return pad


def _to_padded(option_values: torch.Tensor, layout: HeadLayout) -> torch.Tensor:
    return padded_logits(option_values, layout.option_question, layout.option_slot, layout.num_questions,
                         layout.max_options)


def _padded_softmax(option_values: torch.Tensor, layout: HeadLayout) -> torch.Tensor:
    return torch.softmax(_to_padded(option_values, layout), dim=-1)


def load_head(release: Release, *, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None) -> JointSchemaHead:
    """The release's joint schema head, strictly loaded, in float32 unless told otherwise, in eval mode."""
    from safetensors.torch import load_file

    file = release.path / HEAD_WEIGHTS
    with torch.device("meta"):
        head = JointSchemaHead(release.head_config)
    check_head_tensors(file, {name: tuple(t.shape) for name, t in head.state_dict().items()})
    try:
        state = load_file(str(file), device=str(device))
    except Exception as exc:  # truncated data past a valid header
        raise ReleaseError(f"{file}: cannot read tensor data ({exc})") from exc
    dtype = dtype or torch.float32
    head.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return head.eval()
