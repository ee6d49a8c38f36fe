"""How far into a record the joint schema head reads the backbone's hidden states.

Every head reads each question's span (``q_i``, docs/format.md §4 step 2). A head reads the positions after the last
question span only through branches that can be switched off by their weights:

- the option context ``c_ik`` (option spans), through ``option_context_projection``;
- the last real token ``g``, through ``global_projection`` and the lexical prior's anchor ``normalize(q_i + g)``;
- the memory (every token), through the cross-attention of the routing layers and of the field layers, whose
  contribution is ``out_proj.weight @ attention + out_proj.bias``.

When those weights are zero and the prior's scale is negligible, as in the demo model's question-path head
(``clef-local train-head --method question-path``), the head's numbers depend on the hidden states only up to the end
of the record's last question span; the backbone is causal, so those hidden states do not depend on what follows.
The runtime then runs the backbone over that prefix only and leaves the rest of the hidden states zero: a 77-way
BANKING77 question costs ~90 backbone positions instead of ~1,670, with the same probabilities. Real Clef heads use
every branch and always get the whole record.
"""

from __future__ import annotations

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


_FAR_PROJECTIONS = ("option_context_projection.weight", "global_projection.weight")


def _prior_negligible(tensors: Mapping[str, Any]) -> bool:
    if "prior_logit_scale" not in tensors:
        return False
    log_scale = min(float(np.asarray(tensors["prior_logit_scale"]).reshape(-1)[0]), _MAX_LOG_SCALE)
    return math.exp(log_scale) <= PRIOR_NEGLIGIBLE


def reads_question_spans_only(tensors: Mapping[str, Any]) -> bool:
    """True when a head's state dict (``joint_head.safetensors`` as numpy arrays) reads no hidden state after the
    last question span: every branch listed in the module docstring is zero and the prior's scale is negligible."""
    names = list(_FAR_PROJECTIONS)
    names += [f"evidence_layers.{n}.attention.out_proj.weight"
              for n in range(_layer_count(tensors, "evidence_layers."))]
    names += [f"layers.{n}.multihead_attn.out_proj.weight" for n in range(_layer_count(tensors, "layers."))]
    return all(_zero(tensors, name) for name in names) and _prior_negligible(tensors)


def _far_branch(name: str) -> bool:
    return name in _FAR_PROJECTIONS or name.endswith((".attention.out_proj.weight", ".multihead_attn.out_proj.weight"))


def head_reads_question_spans_only(path: Path) -> bool:
    """:func:`reads_question_spans_only` of a ``joint_head.safetensors`` file, reading only the tensors it needs
    (numpy, BF16 widened): the prior's scale first, which ends it for every real Clef head."""
    from clef_local.formats.safetensors import read_numpy

    prior = read_numpy(path, lambda name: name == "prior_logit_scale")
    return _prior_negligible(prior) and reads_question_spans_only({**prior, **read_numpy(path, _far_branch)})


def question_reach(record: EncodedRecord) -> int:
    """Positions the head needs of ``record`` when it reads question spans only: up to its last question span's
    end."""
    return max(question.question_span[1] for question in record.questions)


def batch_reach(records: Iterable[EncodedRecord]) -> int:
    """The backbone positions a padded batch of ``records`` needs (the most any of them needs)."""
    return max(question_reach(record) for record in records)
