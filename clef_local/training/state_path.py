"""The state-path head: a joint schema head whose choices read the state itself, and the batches it trains on.

Why and how (the choice row's type dominance, the distractors and the attention term): docs/demo-model.md, "The
state path". The head is docs/format.md §4 with some branches zero (:func:`state_path_head`), computed by the head's
own :meth:`~clef_local.heads.torch_head.JointSchemaHead.logits` (:func:`state_logits`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from clef_local.heads.torch_head import HeadInputs, JointSchemaHead
from clef_local.runtime.encoding import PREFIX, EncodedRecord, render
from clef_local.runtime.layout import HeadLayout
from clef_local.runtime.schema import TYPE_IDS
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.hidden_cache import cache_hidden_states
from clef_local.training.questions import Questions, Split

# 1e4: a choice field moves by ~1e-4 of its size when q_i changes completely; float32 layer norms over values of
# this size stay exact to ~1e-7, and the logits move by < 1e-3.
CHOICE_DOMINANCE = 1e4
CHOICE = TYPE_IDS["choice"]
PRIOR_OFF = -30.0  # exp(-30) ~ 1e-13: the prior's anchor reads the last token, a schema token


def zeroed_parameters(head: JointSchemaHead) -> list[str]:
    """Names of the parameters that are zero (and frozen) in a state-path head: every branch but the question
    projection, the option-lexical path and the routing layers, and the field layers' output projections (the
    fields pass through those layers unchanged)."""
    names = ["option_context_projection.weight", "option_question_projection.weight", "global_projection.weight",
             "option_summary_norm.weight", "option_summary_norm.bias"]
    blocks = ("self_attn.out_proj", "multihead_attn.out_proj", "linear2")
    return names + [f"layers.{n}.{block}.{p}" for n in range(len(head.layers)) for block in blocks
                    for p in ("weight", "bias")]


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


def state_path_head(head: JointSchemaHead, joint_scale_init: float) -> list[torch.nn.Parameter]:
    """Make a fresh ``head`` a state-path head in place: the :func:`zeroed_parameters` zero and frozen, the prior
    off and frozen, the rest of the field layers frozen (their outputs are zero: nothing they hold reaches a
    logit, so weight decay has nothing to do there either), the cosine scale at ``joint_scale_init``, the choice
    row dominated (:class:`ChoiceDominance`); returns the parameters left to train."""
    params = dict(head.named_parameters())
    frozen = set(zeroed_parameters(head)) | {"prior_logit_scale"} | {n for n in params if n.startswith("layers.")}
    zeroed = set(zeroed_parameters(head))
    with torch.no_grad():
        for name in zeroed:
            params[name].zero_()
        head.prior_logit_scale.fill_(PRIOR_OFF)
        head.joint_logit_scale.fill_(joint_scale_init)
    for name, param in params.items():
        param.requires_grad_(name not in frozen)
    parametrize.register_parametrization(head.type_embedding, "weight",
                                         ChoiceDominance().to(head.type_embedding.weight.device))
    return [p for p in head.parameters() if p.requires_grad]


def fold_choice_dominance(head: JointSchemaHead) -> None:
    """Store the dominated choice row in the weights: the release's plain ``type_embedding.weight``, with which the
    head computes what training computed."""
    parametrize.remove_parametrizations(head.type_embedding, "weight", leave_parametrized=True)


@dataclass
class StateBatch:
    """A batch of records for :func:`state_logits`: ``memory`` ``[B, T, hidden]``, each record's hidden states
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
        """What ``head.read`` gives on whole records, from the cached pieces: the memory after ``hidden_norm``, and
        the question vectors as the affine map of the un-affine means (the mean of an affine map is the map of the
        mean). The option context and the last token feed branches that are zero in a state-path head (the prior
        is off): zeros here."""
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


def state_logits(head: JointSchemaHead, batch: StateBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``[Q, max_options]`` logits (``-inf`` padding) of ``head`` — its own :meth:`~JointSchemaHead.logits`,
    docs/format.md §4 steps 3-7 — and ``[O, routing layers]``, each option query's attention mass on prefix + state
    per routing layer."""
    attention: list[torch.Tensor] = []
    logits = head.logits(batch.inputs(head), batch.layout, routing_attention=attention)
    layout, on_state = batch.layout, batch.state_mask[:, None, :]
    masses = [(weights * on_state.to(weights.dtype)).sum(-1)[layout.option_record, layout.option_record_slot]
              for weights in attention]
    return logits, torch.stack(masses, -1) if masses else logits.new_ones(layout.num_options, 0)


class Distractors:
    """Random stretches of other records' schema hidden states, appended to a memory after the state."""

    def __init__(self, bank: Sequence[torch.Tensor], min_tokens: int = 16) -> None:
        if not bank:
            raise ValueError("the distractor bank is empty")
        self.bank, self.min_tokens = bank, min_tokens

    @property
    def longest(self) -> int:
        return max(len(source) for source in self.bank)

    def draw(self, rng: random.Random, cap: int | None = None) -> torch.Tensor:
        """A stretch of one bank record, ``min_tokens`` to ``cap`` tokens long (as long as that record allows)."""
        source = self.bank[rng.randrange(len(self.bank))]
        longest = len(source) if cap is None else max(1, min(cap, len(source)))
        size = rng.randint(min(self.min_tokens, longest), longest)
        start = rng.randint(0, len(source) - size)
        return source[start : start + size]


@dataclass
class Memories:
    """Per record, the index of its state's hidden states in ``states`` (prefix + state)."""

    states: Sequence[torch.Tensor]
    state_of: list[int]


def make_batch(rows: Sequence[int], questions: Questions, split: Split, memories: Memories, lexical: torch.Tensor,
               distractors: Distractors | None, rng: random.Random) -> tuple[StateBatch, torch.Tensor]:
    """The :class:`StateBatch` of question ``rows`` (whole records, as units give them) and their gold indices;
    ``lexical`` is the lexical table (``[rows, hidden]``) the questions' options index."""
    rows = sorted(rows)
    records = sorted({split.record_of(r) for r in rows})
    position = {record: n for n, record in enumerate(records)}
    parts, state_len = [], []
    # one length cap per batch: a batch pads to its longest memory, so mixing 20- and 1,600-token distractors in
    # every batch would cost the longest every step
    cap = rng.randint(distractors.min_tokens, distractors.longest) if distractors is not None else None
    for record in records:
        state = memories.states[memories.state_of[record]].float()
        tail = [distractors.draw(rng, cap).float()] if distractors is not None else []
        parts.append(torch.cat([state, *tail]))
        state_len.append(len(state))
    width = max(len(p) for p in parts)
    memory = torch.zeros(len(parts), width, parts[0].shape[-1])
    pad = torch.ones(len(parts), width, dtype=torch.bool)
    state_mask = torch.zeros(len(parts), width, dtype=torch.bool)
    for n, part in enumerate(parts):
        memory[n, : len(part)] = part
        pad[n, : len(part)] = False
        state_mask[n, : state_len[n]] = True
    index = torch.tensor(rows)
    options = questions.options[index]
    question, slot = (options >= 0).nonzero(as_tuple=True)
    question_record = torch.tensor([position[split.record_of(r)] for r in rows])
    device = lexical.device
    layout = batch_layout(*(t.to(device) for t in (question_record, questions.types[index], question, slot)))
    batch = StateBatch(memory.to(device), pad.to(device), state_mask.to(device), questions.means[index].to(device),
                       lexical[options[question, slot].to(device)], layout)
    return batch, questions.gold[index].to(device)


def state_records(tokenizer: ReleaseTokenizer, texts: Sequence[str]) -> list[EncodedRecord]:
    """``prefix + state`` of each text as a question-less record, tokenized piece by piece as a request is."""
    prefix = tokenizer.encode_pieces([PREFIX])[0]
    pieces = tokenizer.encode_pieces([render(text) for text in texts])
    return [EncodedRecord(tuple(prefix + ids), (), state_tokens=len(ids), state_start=len(prefix)) for ids in pieces]


def state_bank(backbone_dir: Path, tokenizer: ReleaseTokenizer, texts: Sequence[str], cache: Path,
               device: str = "cpu") -> list[torch.Tensor]:
    """``[prefix + state, hidden]`` hidden states of each text, as a request's first tokens (cached in blocks)."""
    return cache_hidden_states(backbone_dir, state_records(tokenizer, texts), cache, device=device)


def distractor_bank(backbone_dir: Path, records: Sequence[EncodedRecord], cache: Path, device: str = "cpu"
                    ) -> list[torch.Tensor]:
    """The hidden states of each record's schema and suffix (every token after its state), from one full pass."""
    hidden = cache_hidden_states(backbone_dir, records, cache, device=device)
    return [h[r.state_start + r.state_tokens:] for h, r in zip(hidden, records, strict=True)]
