"""Index arrays that let the head work on a whole padded batch at once (docs/format.md §4, "Batched"): a flat index
per question and option, and the tokens of every span listed span after span (CSR), so span means are one
sparse-dense matmul. Built with numpy, so every backend converts it to its own arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from clef_local.runtime.encoding import EncodedRecord


@dataclass(frozen=True)
class HeadLayout:
    """Flat indices of a batch's questions, options and span tokens (``T`` is the padded sequence length).

    Questions are numbered in record then request order (``Q`` in all), options in record, question, option
    order (``O``); token indices are flat positions ``record * T + position``.
    """

    num_questions: int
    num_options: int
    max_options: int  # K: most options of any question
    max_options_per_record: int
    max_questions_per_record: int
    question_record: Any  # [Q] record of each question
    question_slot: Any  # [Q] position of the question in its record
    question_type: Any  # [Q] 0 noul, 1 choice, 2 score
    option_question: Any  # [O] question of each option
    option_slot: Any  # [O] position of the option in its question
    option_record: Any  # [O] record of each option
    option_record_slot: Any  # [O] position of the option among its record's options
    question_token_index: Any  # flat positions of question-span tokens, question after question
    question_token_offsets: Any  # [Q + 1] CSR row offsets into question_token_index
    option_token_index: Any  # flat positions of option-span tokens, option after option
    option_token_offsets: Any  # [O + 1] CSR row offsets into option_token_index
    option_token_ids: Any  # the input ids at those positions (lexical rows to gather)
    record_last_index: Any  # [B] flat position of each record's last real token

    def map(self, convert: Callable[[np.ndarray], Any]) -> HeadLayout:
        """The same layout with every array converted (e.g. ``torch.from_numpy``)."""
        arrays = {f.name: convert(getattr(self, f.name)) for f in fields(self) if isinstance(
            getattr(self, f.name), np.ndarray)}
        return replace(self, **arrays)


def _span_tokens(spans: list[tuple[int, int]], offsets: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Flat positions of the tokens inside ``spans`` (start/end, plus each span's record offset), span after
    span, and the CSR row offsets (where each span's tokens start in that list)."""
    arr = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    lengths = arr[:, 1] - arr[:, 0]
    first = arr[:, 0] + np.asarray(offsets, dtype=np.int64)
    # position = span start + offset + (running token index - tokens before this span)
    skipped = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    positions = np.repeat(first - skipped, lengths) + np.arange(int(lengths.sum()))
    return positions, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def build_layout(records: Sequence[EncodedRecord], seq_len: int) -> HeadLayout:
    """Index arrays for ``records`` right-padded to ``seq_len`` tokens."""
    q_record: list[int] = []
    q_slot: list[int] = []
    q_type: list[int] = []
    o_question: list[int] = []
    o_slot: list[int] = []
    o_record: list[int] = []
    o_record_slot: list[int] = []
    q_spans: list[tuple[int, int]] = []
    o_spans: list[tuple[int, int]] = []
    q_offsets: list[int] = []
    o_offsets: list[int] = []
    last_index: list[int] = []
    q_count = 0
    for r, record in enumerate(records):
        offset = r * seq_len
        last_index.append(offset + len(record.input_ids) - 1)
        n_record_options = 0
        for s, question in enumerate(record.questions):
            q_record.append(r)
            q_slot.append(s)
            q_type.append(question.question_type)
            q_spans.append(question.question_span)
            q_offsets.append(offset)
            k = len(question.option_spans)
            o_question.extend([q_count] * k)
            o_slot.extend(range(k))
            o_record.extend([r] * k)
            o_record_slot.extend(range(n_record_options, n_record_options + k))
            o_spans.extend(question.option_spans)
            o_offsets.extend([offset] * k)
            n_record_options += k
            q_count += 1

    q_tok, q_rows = _span_tokens(q_spans, q_offsets)
    o_tok, o_rows = _span_tokens(o_spans, o_offsets)
    flat_ids = np.zeros(len(records) * seq_len, dtype=np.int64)
    for r, record in enumerate(records):
        flat_ids[r * seq_len : r * seq_len + len(record.input_ids)] = record.input_ids

    def arr(values: list[int]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)

    o_slot_arr = arr(o_slot)
    o_record_slot_arr = arr(o_record_slot)
    q_slot_arr = arr(q_slot)
    return HeadLayout(
        num_questions=q_count,
        num_options=len(o_question),
        max_options=int(o_slot_arr.max()) + 1,
        max_options_per_record=int(o_record_slot_arr.max()) + 1,
        max_questions_per_record=int(q_slot_arr.max()) + 1,
        question_record=arr(q_record),
        question_slot=q_slot_arr,
        question_type=arr(q_type),
        option_question=arr(o_question),
        option_slot=o_slot_arr,
        option_record=arr(o_record),
        option_record_slot=o_record_slot_arr,
        question_token_index=q_tok,
        question_token_offsets=q_rows,
        option_token_index=o_tok,
        option_token_offsets=o_rows,
        option_token_ids=flat_ids[o_tok],
        record_last_index=arr(last_index),
    )


def pad_batch(records: Sequence[EncodedRecord], pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int64 ``input_ids`` and ``attention_mask`` (1 on real tokens), as every backend feeds them."""
    length = max(len(r.input_ids) for r in records)
    ids = np.full((len(records), length), pad_token_id, dtype=np.int64)
    mask = np.zeros((len(records), length), dtype=np.int64)
    for i, record in enumerate(records):
        ids[i, : len(record.input_ids)] = record.input_ids
        mask[i, : len(record.input_ids)] = 1
    return ids, mask
