"""How far into a record the joint schema head reads the backbone's hidden states, from the head's own weights.

The backbone is causal: a position's hidden state depends only on the positions before it. So the backbone need run
only up to the last position the head reads, and the probabilities are those of the whole record. Which positions a
head reads follows from which of its branches are live (docs/format.md §4):

- every head reads each question's span (``q_i``, step 2): a question's span comes before its options;
- the option context ``c_ik`` reads the option spans, through ``option_context_projection``;
- the last real token ``g`` is read through ``global_projection`` and the lexical prior's anchor
  ``normalize(q_i + g)``;
- the memory (every token) is read through the cross-attention of the routing and of the field layers, whose
  contribution is ``out_proj.weight @ attention + out_proj.bias``: with a zero weight it is a constant.

:func:`reach_of` turns that into a :class:`Reach`: to the last question span (only ``q_i`` is read: the demo
model's question-path heads, ``clef-local train-head --method question-path`` or ``--adapters``), to the last option
span (the option context is live too), or the whole record (the memory, the last token or the prior is live: real
Clef heads, the state-path head). A 77-way BANKING77 question read to its question span costs ~90 backbone
positions instead of ~1,670, with the same probabilities.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from clef_local.runtime.encoding import EncodedRecord

# A prior scale below this changes no logit by more than it (the prior is scale × a cosine): under float32's
# resolution for logits of order one, so cutting the pass leaves the probabilities as they were.
PRIOR_NEGLIGIBLE = 1e-9
_MAX_LOG_SCALE = math.log(100.0)


def _zero(tensors: Mapping[str, Any], name: str) -> bool:
    return name in tensors and not np.any(np.asarray(tensors[name]))


def _layer_count(tensors: Mapping[str, Any], prefix: str) -> int:
    return len({name.split(".")[1] for name in tensors if name.startswith(prefix)})


_FAR_PROJECTIONS = ("option_context_projection.weight", "global_projection.weight")  # read by _far_branch


def _prior_negligible(tensors: Mapping[str, Any]) -> bool:
    if "prior_logit_scale" not in tensors:
        return False
    log_scale = min(float(np.asarray(tensors["prior_logit_scale"]).reshape(-1)[0]), _MAX_LOG_SCALE)
    return math.exp(log_scale) <= PRIOR_NEGLIGIBLE


class Reach(enum.Enum):
    """The last positions of a record a head reads."""

    QUESTION_SPANS = "to the last question span"
    OPTION_SPANS = "to the last option span"
    WHOLE_RECORD = "whole record"


def _memory_names(tensors: Mapping[str, Any]) -> list[str]:
    names = [f"evidence_layers.{n}.attention.out_proj.weight"
             for n in range(_layer_count(tensors, "evidence_layers."))]
    return names + [f"layers.{n}.multihead_attn.out_proj.weight" for n in range(_layer_count(tensors, "layers."))]


def reach_of(tensors: Mapping[str, Any]) -> Reach:
    """How far a head with this state dict (``joint_head.safetensors`` as numpy arrays) reads a record: the whole
    record when the memory, the last token or the prior is live; to the last option span when only the option
    context is live besides the question spans; else to the last question span (module docstring)."""
    far = [*_memory_names(tensors), "global_projection.weight"]
    if not (all(_zero(tensors, name) for name in far) and _prior_negligible(tensors)):
        return Reach.WHOLE_RECORD
    if not _zero(tensors, "option_context_projection.weight"):
        return Reach.OPTION_SPANS
    return Reach.QUESTION_SPANS


def reads_question_spans_only(tensors: Mapping[str, Any]) -> bool:
    """True when a head's state dict reads no hidden state after the last question span (:func:`reach_of`)."""
    return reach_of(tensors) is Reach.QUESTION_SPANS


def _far_branch(name: str) -> bool:
    return name in _FAR_PROJECTIONS or name.endswith((".attention.out_proj.weight", ".multihead_attn.out_proj.weight"))


def head_reach(path: Path) -> Reach:
    """:func:`reach_of` of a ``joint_head.safetensors`` file, reading only the tensors it needs (numpy, BF16
    widened): the prior's scale first, which ends it for every real Clef head."""
    from clef_local.formats.safetensors import read_numpy

    prior = read_numpy(path, lambda name: name == "prior_logit_scale")
    if not _prior_negligible(prior):
        return Reach.WHOLE_RECORD
    return reach_of({**prior, **read_numpy(path, _far_branch)})


def head_reads_question_spans_only(path: Path) -> bool:
    """Whether the head in ``path`` reads no hidden state after the last question span (:func:`head_reach`)."""
    return head_reach(path) is Reach.QUESTION_SPANS


def question_reach(record: EncodedRecord) -> int:
    """Positions the head needs of ``record`` when it reads question spans only: up to its last question span's
    end."""
    return max(question.question_span[1] for question in record.questions)


def record_reach(record: EncodedRecord, reach: Reach) -> int:
    """The backbone positions a head of ``reach`` needs of ``record``."""
    if reach is Reach.QUESTION_SPANS:
        return question_reach(record)
    if reach is Reach.OPTION_SPANS:
        return max(span[1] for question in record.questions for span in question.option_spans)
    return len(record.input_ids)


def batch_reach(records: Iterable[EncodedRecord], reach: Reach = Reach.QUESTION_SPANS) -> int:
    """The backbone positions a padded batch of ``records`` needs (the most any of them needs)."""
    return max(record_reach(record, reach) for record in records)
