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

from clef_local.heads.torch_head import EvidenceRoutingLayer, JointSchemaHead, padded_logits
from clef_local.runtime.encoding import EncodedRecord
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
