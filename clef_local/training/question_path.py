"""Train a joint schema head through its question path: ``clef-local train-head --method question-path``.

docs/format.md §4 scores option *k* of question *i* from a field vector ``F_i`` and an option vector ``o_ik``. When the
head's routing layers, field layers, option summary, global and option-context branches output zero (their output
projections are zero, like a zero-initialised residual branch), what is left is

    F_i    = field_norm(question_projection(q_i) + type_embedding(t_i))
    o_ik   = option_norm(option_lexical_projection(l_ik) + option_question_projection(q_i))
    logit  = sigmoid(residual_gate) · (exp(joint_logit_scale) · cos(F_i, o_ik) + residual_scorer([F, o, F·o, |F−o|]))

(the lexical prior also reads the last token, so its scale is held at e^-30: off). That head depends on the
backbone only through ``q_i``, the mean of ``hidden_norm(H)`` over the question's span, and a question's span comes
before its options: the backbone pass can stop at the end of the record's last question span. A 77-way BANKING77
question then costs ~90 tokens instead of 1,670, so every training row fits in a CPU budget. The trained head is a
complete release head (strict load, every tensor present) that computes the same numbers on the full prompt; the
zeroed branches are ready to be trained on top of it by the full trainer (``--init``).

Why this path carries the decision: a logistic regression on the mean of a 77-way question's span hidden states
(3,000 training rows) scores 0.862 on BANKING77 test, against 0.808 on the state tokens' mean.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from clef_local.formats.release import read_json
from clef_local.heads.torch_head import JointSchemaHead, padded_logits
from clef_local.runtime.encoding import EncodedRecord
from clef_local.training.hidden_cache import cache_dtype, token_batches

log = logging.getLogger(__name__)

PRIOR_OFF = -30.0  # exp(-30) ~ 1e-13: the prior reads the last token, which this path never computes
BLOCK_RECORDS = 512  # cache unit, as in hidden_cache: a larger training set reuses the blocks of a smaller one


def zeroed_parameters(head: JointSchemaHead) -> list[str]:
    """Names of the parameters that are zero (and frozen) in a question-path head."""
    names = ["option_context_projection.weight", "global_projection.weight", "option_summary_norm.weight",
             "option_summary_norm.bias"]
    for n in range(len(head.evidence_layers)):
        names += [f"evidence_layers.{n}.attention.out_proj.{p}" for p in ("weight", "bias")]
        names += [f"evidence_layers.{n}.feedforward.3.{p}" for p in ("weight", "bias")]
    return names + field_layer_outputs(head)


def field_layer_outputs(head: JointSchemaHead) -> list[str]:
    """Names of the field layers' output projections (zero: the fields pass through those layers unchanged)."""
    return [f"layers.{n}.{block}.{p}" for n in range(len(head.layers))
            for block in ("self_attn.out_proj", "multihead_attn.out_proj", "linear2") for p in ("weight", "bias")]


def question_path_head(head: JointSchemaHead, joint_scale_init: float) -> list[torch.nn.Parameter]:
    """Zero ``head``'s other branches and the prior in place; return the parameters left to train."""
    return freeze_branches(head, zeroed_parameters(head), joint_scale_init)


def freeze_branches(head: JointSchemaHead, zeroed: list[str], joint_scale_init: float) -> list[torch.nn.Parameter]:
    """Zero and freeze the ``zeroed`` parameters and the prior, start the cosine scale at ``joint_scale_init``;
    return the parameters left to train."""
    frozen = set(zeroed) | {"prior_logit_scale"}
    params = dict(head.named_parameters())
    with torch.no_grad():
        for name in frozen - {"prior_logit_scale"}:
            params[name].zero_()
        head.prior_logit_scale.fill_(PRIOR_OFF)
        head.joint_logit_scale.fill_(joint_scale_init)
    for name, param in params.items():
        param.requires_grad_(name not in frozen)
    return [p for name, p in params.items() if name not in frozen]


@dataclass
class QuestionBatch:
    """Questions of a question-path batch: ``means`` ``[Q, hidden]`` (span means of the *un-affine* layer norm of the
    hidden states), ``types`` ``[Q]``, and per option its question, slot and lexical row."""

    means: torch.Tensor
    types: torch.Tensor
    option_question: torch.Tensor
    option_slot: torch.Tensor
    lexical: torch.Tensor  # [U, hidden]: mean output-embedding rows of the distinct option spans
    option_lexical: torch.Tensor  # [O]: each option's row of ``lexical`` (projected once per distinct option)
    max_options: int


def question_path_logits(head: JointSchemaHead, batch: QuestionBatch) -> torch.Tensor:
    """``[Q, max_options]`` logits (``-inf`` padding) of a question-path head: the full forward's numbers."""
    norm = head.hidden_norm
    question = batch.means * norm.weight + norm.bias  # the mean of an affine map is the map of the mean
    fields = head.field_norm(head.question_projection(question) + head.type_embedding(batch.types))
    options = head.option_norm(head.option_lexical_projection(batch.lexical)[batch.option_lexical]
                               + head.option_question_projection(question)[batch.option_question])
    logits = head.score_options(fields[batch.option_question], options)
    return padded_logits(logits, batch.option_question, batch.option_slot, len(batch.means), batch.max_options)


def truncate_to_questions(record: EncodedRecord) -> EncodedRecord:
    """``record`` cut after its last question span: all a question-path head reads."""
    return replace(record, input_ids=record.input_ids[:max(q.question_span[1] for q in record.questions)])


def _blocks(encoded: Sequence[EncodedRecord], device: str, block_records: int
            ) -> tuple[torch.dtype, list[EncodedRecord], list[list[int]], list[str]]:
    dtype = cache_dtype(device)
    cut = [truncate_to_questions(r) for r in encoded]
    blocks = [list(range(s, min(s + block_records, len(cut)))) for s in range(0, len(cut), block_records)]
    return dtype, cut, blocks, [_block_name([cut[i] for i in block], dtype) for block in blocks]


def means_cached(encoded: Sequence[EncodedRecord], cache: Path, *, device: str = "cpu",
                 block_records: int = BLOCK_RECORDS) -> bool:
    """Whether :func:`question_means` of ``encoded`` would only read ``cache`` (every block already written)."""
    return all((cache / name).is_file() for name in _blocks(encoded, device, block_records)[3])


def question_means(backbone_dir: Path, encoded: Sequence[EncodedRecord], cache: Path, *, device: str = "cpu",
                   block_records: int = BLOCK_RECORDS) -> list[np.ndarray]:
    """Per record, ``[questions, hidden]`` float32 span means of the un-affine layer norm of the final hidden
    states, computed on the records cut after their last question span and cached in blocks named by their token
    ids and dtype (written atomically: a killed run resumes at the first missing block)."""
    from clef_local.backends.torch_backend import TorchBackbone

    dtype, cut, blocks, names = _blocks(encoded, device, block_records)
    todo = [b for b, name in enumerate(names) if not (cache / name).is_file()]
    if todo:
        backbone = TorchBackbone(backbone_dir, read_json(backbone_dir / "config.json"), device=device, dtype=dtype)
        tokens = sum(len(cut[i].input_ids) for b in todo for i in blocks[b])
        log.info("question-span means: %d of %d blocks to compute (%d tokens)", len(todo), len(blocks), tokens)
        cache.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        for b in tqdm(todo, desc="question-span means", unit="block"):
            means = _block_means(backbone, [cut[i] for i in blocks[b]], 4096 if device == "cpu" else 16384)
            tmp = cache / f".{names[b]}.tmp"
            save_file({str(n): m for n, m in enumerate(means)}, str(tmp))
            os.replace(tmp, cache / names[b])
        log.info("computed %d blocks in %.0f s", len(todo), time.perf_counter() - started)
    out: list[np.ndarray] = []
    for block, name in zip(blocks, names, strict=True):
        try:
            stored = load_file(str(cache / name))
        except (SafetensorError, OSError) as error:
            raise RuntimeError(f"{cache / name}: unreadable cache block ({error}); delete it and run again") from error
        if len(stored) != len(block):
            raise RuntimeError(f"{cache / name}: holds {len(stored)} records, expected {len(block)}; delete it")
        out += [stored[str(n)].numpy() for n in range(len(block))]
    return out


def _block_name(block: Sequence[EncodedRecord], dtype: torch.dtype) -> str:
    digest = hashlib.sha256(str(dtype).encode())
    for record in block:
        digest.update(np.asarray(record.input_ids, dtype=np.int64).tobytes())
        for question in record.questions:
            digest.update(np.asarray(question.question_span, dtype=np.int64).tobytes())
        digest.update(b"|")
    return f"means-{digest.hexdigest()[:16]}.safetensors"


@torch.inference_mode()
def _block_means(backbone, records: Sequence[EncodedRecord], batch_tokens: int) -> list[torch.Tensor]:
    from clef_local.backends.torch_backend import collate

    means: list[torch.Tensor | None] = [None] * len(records)
    order = sorted(range(len(records)), key=lambda i: len(records[i].input_ids))
    for batch in token_batches(order, records, batch_tokens):
        ids, mask = collate([records[i] for i in batch], 0, backbone.device)
        hidden = backbone.forward(ids, mask).float()
        normed = F.layer_norm(hidden, hidden.shape[-1:])
        for row, i in enumerate(batch):
            means[i] = torch.stack([normed[row, a:b].mean(0) for a, b in
                                    (q.question_span for q in records[i].questions)]).cpu().contiguous()
    return means


class LexicalTable:
    """Mean output-embedding row of every distinct option span (options repeat across records: computed once)."""

    def __init__(self, embedding: torch.Tensor) -> None:
        self.embedding = embedding
        self.index: dict[tuple[int, ...], int] = {}
        self.rows: list[torch.Tensor] = []

    def row(self, token_ids: Sequence[int]) -> int:
        """The table row of the option span ``token_ids`` (added on first sight)."""
        key = tuple(token_ids)
        if key not in self.index:
            self.index[key] = len(self.rows)
            self.rows.append(self.embedding[list(key)].float().mean(0))
        return self.index[key]

    def lookup(self, record: EncodedRecord, question: int) -> list[int]:
        """The rows of question ``question``'s options in ``record``."""
        return [self.row(record.input_ids[a:b]) for a, b in record.questions[question].option_spans]

    def tensor(self) -> torch.Tensor:
        return torch.stack(self.rows)


def apply_temperature(head: JointSchemaHead, temperature: float) -> None:
    """Multiply every logit of ``head`` by ``temperature``, in its own weights: the cosine temperature and the residual
    scorer's output layer both scale (the prior is off in a question-path head), so the release format is unchanged."""
    scale = float(head.joint_logit_scale.detach()) + math.log(temperature)
    if scale > math.log(100.0):
        raise ValueError(f"temperature {temperature:.3f} would take the cosine scale past its clamp of 100 "
                         f"(exp({scale:.2f})); the head is too far from calibrated to fix this way")
    with torch.no_grad():
        head.joint_logit_scale.fill_(scale)
        head.residual_scorer[3].weight.mul_(temperature)
        head.residual_scorer[3].bias.mul_(temperature)
