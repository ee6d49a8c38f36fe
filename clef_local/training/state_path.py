"""A joint schema head whose choices read the state itself: ``clef-local train-head --method state-path``.

Why. A question's span comes after the schema's ids and the questions before it, so everything a question-path head
reads (:mod:`.question_path`) moves when ids are renamed, questions reordered or others added: the shipped
question-path head moved a BANKING77 intent choice by 0.37 / 0.59 / 0.82 on average. The state's own tokens come
*before* the schema, and causal attention keeps their hidden states exactly the same under all three. A choice is
defined by its options, whose lexical rows (mean output-embedding rows of the option span's ids) depend on nothing
else either. So this head answers a choice from the state's tokens and its options alone:

    o_ik   = option_norm(route(option_lexical_projection(l_ik)))     routing layers attend to the memory
    F_i    = field_norm(question_projection(q_i) + type_embedding(t_i))
    logit  = sigmoid(residual_gate) · (exp(joint_logit_scale) · cos(F_i, o_ik) + residual_scorer([F, o, F·o, |F−o|]))

with the option-context, option-question, global and option-summary branches and the field layers' outputs zero and
the lexical prior off (its anchor reads the last token). Two things make a choice's answer independent of the schema:

- **Type dominance.** The choice row of ``type_embedding`` is stored ×``CHOICE_DOMINANCE``. Layer norm is scale
  invariant, so a choice's field is that row's direction and ``q_i`` moves it by ~1e-5 of its size. Nouls and scores
  keep reading their question span (a noul's proposition is nowhere else in the prompt, nor are the intents a count
  question lists).
- **Attention on the state.** The memory holds every token of the record. Training puts the schema tokens of *other*
  records ("distractors", cached once) after each record's prefix + state, and adds ``-log`` of the attention mass
  on prefix + state to the loss, so the routing layers learn to read the state and pass over schema tokens.

Training costs a state-only pass per distinct state (~50 tokens for a BANKING77 message, not the 1,670 of a 77-option
request), a full pass for the few distractor records, and question-span means for the nouls and scores only: a choice
costs no backbone pass at all, so every BANKING77 row is asked over all 77 intents for free. At inference the head
reads the whole record (its routing layers are live), so the backbone runs over every token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from clef_local.heads.torch_head import EvidenceRoutingLayer, HeadInputs, JointSchemaHead, padded_logits
from clef_local.runtime.encoding import EncodedRecord
from clef_local.runtime.layout import HeadLayout
from clef_local.runtime.schema import TYPE_IDS
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.hidden_cache import cache_hidden_states
from clef_local.training.question_path import field_layer_outputs, freeze_branches
from clef_local.training.splicing import state_records

# 1e4: a choice field moves by ~1e-4 of its size when q_i changes completely; float32 layer norms over values of
# this size stay exact to ~1e-7, and the logits move by < 1e-3.
CHOICE_DOMINANCE = 1e4
CHOICE = TYPE_IDS["choice"]


def zeroed_parameters(head: JointSchemaHead) -> list[str]:
    """Names of the parameters that are zero (and frozen) in a state-path head."""
    names = ["option_context_projection.weight", "option_question_projection.weight", "global_projection.weight",
             "option_summary_norm.weight", "option_summary_norm.bias"]
    return names + field_layer_outputs(head)


def state_path_head(head: JointSchemaHead, joint_scale_init: float) -> list[torch.nn.Parameter]:
    """Zero ``head``'s other branches and the prior in place; return the parameters left to train."""
    return freeze_branches(head, zeroed_parameters(head), joint_scale_init)


def fold_dominance(head: JointSchemaHead, dominance: float = CHOICE_DOMINANCE) -> None:
    """Store the choice row of the type embedding ×``dominance`` (training multiplies it on the fly): the saved head
    then computes, with the release's own math, what :func:`state_path_logits` computed while training."""
    with torch.no_grad():
        head.type_embedding.weight[CHOICE].mul_(dominance)


class ChoiceDominance(nn.Module):
    """The parametrization of ``type_embedding.weight`` while training: the choice row ×``dominance``, the stored
    row left at its trained scale (Adam's steps stay relative to it); removed with ``leave_parametrized=True`` at
    save (:func:`fold_choice_dominance`), which stores the product."""

    def __init__(self, dominance: float = CHOICE_DOMINANCE) -> None:
        super().__init__()
        scale = torch.ones(3, 1)
        scale[CHOICE] = dominance
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.scale


def dominate_choices(head: JointSchemaHead, dominance: float = CHOICE_DOMINANCE) -> None:
    """Multiply the choice row of ``head``'s type embedding by ``dominance`` in every forward (training)."""
    parametrize.register_parametrization(head.type_embedding, "weight",
                                         ChoiceDominance(dominance).to(head.type_embedding.weight.device))


def fold_choice_dominance(head: JointSchemaHead) -> None:
    """Store the dominated choice row in the weights (the release's plain ``type_embedding.weight``)."""
    parametrize.remove_parametrizations(head.type_embedding, "weight", leave_parametrized=True)


@dataclass
class PathBatch:
    """A batch of records for :func:`path_logits`: ``memory`` ``[B, T, hidden]``, each record's hidden states
    (prefix + state, then any distractor tokens), right padded (``memory_pad`` true on padding, ``state_mask`` true
    on prefix + state); ``means`` ``[Q, hidden]`` the questions' span means of the *un-affine* layer norm (only nouls
    and scores read them: a choice's may be anything); ``lexical`` ``[O, hidden]`` each option's mean
    output-embedding row; ``layout`` numbers questions and options as :func:`clef_local.runtime.layout.build_layout`
    does (its token-span arrays are empty: the spans were read when the means were cached)."""

    memory: torch.Tensor
    memory_pad: torch.Tensor
    state_mask: torch.Tensor
    means: torch.Tensor
    lexical: torch.Tensor
    layout: HeadLayout

    def inputs(self, head: JointSchemaHead) -> HeadInputs:
        """What ``head.read`` would give on whole records, from the cached pieces: the memory after
        ``hidden_norm``, and the question vectors as the affine map of the un-affine means (the mean of an affine
        map is the map of the mean). The option context and the last token feed branches that are zero in a
        state-path head; they are zeros here."""
        norm = head.hidden_norm
        options, records = self.lexical.shape[0], self.memory.shape[0]
        return HeadInputs(hidden=norm(self.memory), memory_pad=self.memory_pad if bool(self.memory_pad.any()) else None,
                          question=self.means * norm.weight + norm.bias,
                          option_context=self.lexical.new_zeros(options, self.lexical.shape[-1]),
                          option_lexical=self.lexical, last=self.memory.new_zeros(records, self.memory.shape[-1]))


def batch_layout(question_record: torch.Tensor, question_type: torch.Tensor, option_question: torch.Tensor,
                 option_slot: torch.Tensor) -> HeadLayout:
    """The :class:`HeadLayout` of questions numbered record after record (``question_record`` ``[Q]``, sorted) and
    their options (``option_question``, ``option_slot`` ``[O]``, in question then slot order): the slots of each
    question in its record and of each option among its record's options are running counts."""
    def running(group: torch.Tensor) -> torch.Tensor:  # position of each element among the earlier ones of its group
        first = torch.searchsorted(group, group)  # group is sorted: the index of its first element
        return torch.arange(len(group), device=group.device) - first

    option_record = question_record[option_question]
    question_slot, option_record_slot = running(question_record), running(option_record)
    empty = question_record.new_zeros(0)
    return HeadLayout(
        num_questions=len(question_record), num_options=len(option_question),
        max_options=int(option_slot.max()) + 1, max_options_per_record=int(option_record_slot.max()) + 1,
        max_questions_per_record=int(question_slot.max()) + 1, question_record=question_record,
        question_slot=question_slot, question_type=question_type, option_question=option_question,
        option_slot=option_slot, option_record=option_record, option_record_slot=option_record_slot,
        question_token_index=empty, question_token_offsets=empty, option_token_index=empty,
        option_token_offsets=empty, option_token_ids=empty, record_last_index=empty)


def path_logits(head: JointSchemaHead, batch: PathBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``[Q, max_options]`` logits of ``head`` (its own :meth:`~JointSchemaHead.logits`, docs/format.md §4 steps
    3-7) and ``[O, routing layers]``, each option query's attention mass on prefix + state per routing layer."""
    attention: list[torch.Tensor] = []
    logits = head.logits(batch.inputs(head), batch.layout, routing_attention=attention)
    layout, on_state = batch.layout, batch.state_mask[:, None, :]
    masses = [(weights * on_state.to(weights.dtype)).sum(-1)[layout.option_record, layout.option_record_slot]
              for weights in attention]
    return logits, torch.stack(masses, -1) if masses else logits.new_ones(layout.num_options, 0)


def twin_whitening(means: torch.Tensor, pairs: Sequence[tuple[int, int]], strength: float) -> torch.Tensor:
    """A symmetric ``[hidden, hidden]`` map that whitens the span means' *within-twin* scatter (how one question's
    mean moves when ids are renamed, questions reordered or added): ``(S_w + strength · mean eigenvalue · I)^-1/2``,
    scaled to keep the means' mean squared norm. Trained on ``means @ T``, a head's question projection prefers the
    directions that such changes do not move (linear discriminant analysis with the twins as classes)."""
    if not pairs:
        raise ValueError("no twin pairs to estimate the within-twin scatter from")
    if strength <= 0:
        raise ValueError(f"whitening strength must be positive, got {strength}")
    first = means[[a for a, _ in pairs]].double()
    diffs = first - means[[b for _, b in pairs]].double()
    scatter = diffs.T @ diffs / (2 * len(diffs))
    values, vectors = torch.linalg.eigh(scatter)
    values = values.clamp_min(0) + strength * values.clamp_min(0).mean()
    transform = vectors @ torch.diag(values.rsqrt()) @ vectors.T
    ratio = (means.double().square().sum(-1).mean() / (means.double() @ transform).square().sum(-1).mean()).sqrt()
    return (transform * ratio).to(means.dtype)


def fold_whitening(head: JointSchemaHead, transform: torch.Tensor) -> None:
    """Fold ``transform`` (applied to the un-affine span means while training) into the question projection, so the
    head computes the same fields from raw span means: ``W' = W·diag(γ)·T·diag(1/γ)`` and the constant this leaves,
    ``W·β − W'·β``, added to every type embedding row (``γ``, ``β``: the hidden norm's weight and bias)."""
    gamma, beta = head.hidden_norm.weight.detach(), head.hidden_norm.bias.detach()
    if bool((gamma.abs() < 1e-6).any()):
        raise ValueError("the hidden norm has a zero weight: a whitening cannot be folded through it")
    with torch.no_grad():
        weight = head.question_projection.weight
        folded = (weight * gamma) @ transform.to(weight.dtype) / gamma
        head.type_embedding.weight.add_(weight @ beta - folded @ beta)
        weight.copy_(folded)


@dataclass
class StateBatch:
    """A batch of records for :func:`state_path_logits`.

    ``memory`` ``[B, T, hidden]``: each record's hidden states (prefix + state, then any distractor tokens), right
    padded (``memory_pad`` true on padding; ``state_mask`` true on prefix + state). Questions are numbered record after
    record (``question_record`` ``[Q]``), with ``means`` ``[Q, hidden]`` their span means of the un-affine layer norm
    (only nouls and scores read them; a choice's may be anything). Options: their question, slot in it, record, slot
    among the record's options, and row of ``lexical`` (``[U, hidden]``, mean output-embedding rows).
    """

    memory: torch.Tensor
    memory_pad: torch.Tensor
    state_mask: torch.Tensor
    means: torch.Tensor
    types: torch.Tensor
    question_record: torch.Tensor
    option_question: torch.Tensor
    option_slot: torch.Tensor
    option_record: torch.Tensor
    option_record_slot: torch.Tensor
    lexical: torch.Tensor
    option_lexical: torch.Tensor
    max_options: int
    max_record_options: int


def _route(layer: EvidenceRoutingLayer, queries: torch.Tensor, memory: torch.Tensor, pad: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One evidence-routing layer (the head's math) that also returns its head-averaged attention ``[B, K, T]``."""
    normed = layer.memory_norm(memory)
    routed, weights = layer.attention(layer.query_norm(queries), normed, normed, key_padding_mask=pad,
                                      need_weights=True, average_attn_weights=True)
    queries = queries + layer.attention_dropout(routed)
    return queries + layer.feedforward(layer.feedforward_norm(queries)), weights


def state_path_logits(head: JointSchemaHead, batch: StateBatch, dominance: float = CHOICE_DOMINANCE
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[Q, max_options]`` logits (``-inf`` padding) of a state-path head — the full forward's numbers on the same
    hidden states — and ``[O, layers]``, each option query's attention mass on prefix + state per routing layer.

    ``dominance``: the choice row's multiplier not yet folded into the weights (1 for a saved head)."""
    hidden = head.hidden_norm(batch.memory)
    memory = head.memory_projection(hidden)
    pad = batch.memory_pad if bool(batch.memory_pad.any()) else None
    queries = head.option_lexical_projection(batch.lexical)[batch.option_lexical]
    routed = queries.new_zeros(batch.memory.shape[0], batch.max_record_options, queries.shape[-1])
    routed = routed.index_put((batch.option_record, batch.option_record_slot), queries)
    masses = []
    for layer in head.evidence_layers:
        routed, weights = _route(layer, routed, memory, pad)
        mass = (weights * batch.state_mask[:, None, :].to(weights.dtype)).sum(-1)
        masses.append(mass[batch.option_record, batch.option_record_slot])
    routed = routed[batch.option_record, batch.option_record_slot]  # [O, w]

    norm = head.hidden_norm
    question = batch.means * norm.weight + norm.bias  # the mean of an affine map is the map of the mean
    scale = torch.ones(3, device=question.device, dtype=question.dtype)
    scale[CHOICE] = dominance
    fields = head.field_norm(head.question_projection(question)
                             + head.type_embedding(batch.types) * scale[batch.types, None])
    logits = head.score_options(fields[batch.option_question], head.option_norm(routed))
    mass = torch.stack(masses, -1) if masses else logits.new_ones(len(logits), 0)
    return padded_logits(logits, batch.option_question, batch.option_slot, len(batch.types), batch.max_options), mass


def state_mass_loss(mass: torch.Tensor) -> torch.Tensor:
    """Mean ``-log`` attention mass on prefix + state (0 when every query reads only the state)."""
    return -mass.clamp_min(1e-9).log().mean() if mass.numel() else mass.new_zeros(())


def state_bank(backbone_dir, tokenizer: ReleaseTokenizer, texts: Sequence[str], cache, device: str = "cpu"
               ) -> list[torch.Tensor]:
    """``[prefix + state, hidden]`` hidden states of each text, as a request's first tokens (cached in blocks)."""
    return cache_hidden_states(backbone_dir, state_records(tokenizer, texts), cache, device=device)


def distractor_bank(backbone_dir, records: Sequence[EncodedRecord], cache, device: str = "cpu"
                    ) -> list[torch.Tensor]:
    """The hidden states of each record's schema and suffix (every token after its state), from one full pass."""
    hidden = cache_hidden_states(backbone_dir, records, cache, device=device)
    return [h[r.state_start + r.state_tokens:] for h, r in zip(hidden, records, strict=True)]
