"""The question table of a training run and its validation split. Every question of every record is a row; a
choice whose gold lies in an option universe (the 77 BANKING77 intents) is also asked over all of it, a *full view*
that costs no backbone pass. Units (a record, or both records of a twin) train together and are what the split cuts.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from clef_local.data.datasets import Twin
from clef_local.runtime.encoding import EncodedRecord, option_semantics
from clef_local.runtime.schema import TYPE_IDS
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.records import LexicalTable


@dataclass
class Questions:
    """Every training question (and view) as arrays: span mean, type, gold, padded lexical-option ids."""

    means: torch.Tensor  # [N, hidden] span means of the un-affine layer norm (zeros where none was computed)
    types: torch.Tensor  # [N]
    gold: torch.Tensor  # [N], -1 without a label
    options: torch.Tensor  # [N, K] rows of the lexical table, -1 padding
    full_view: torch.Tensor  # [N] bool: a view over the whole universe


def build_questions(tokenizer: ReleaseTokenizer, encoded: Sequence[EncodedRecord], gold: Sequence[Sequence[int]],
                    means: Sequence[np.ndarray], table: LexicalTable, universe: Sequence[str] = ()
                    ) -> tuple[Questions, list[list[int]]]:
    """The question table and, per record, the rows of its questions (views are extra rows, not listed)."""
    universe_ids = [table.row(ids) for ids in tokenizer.encode_pieces([option_semantics(u, None)
                                                                       for u in sorted(universe)])] if universe else []
    order = sorted(universe)
    rows_of: list[list[int]] = []
    vecs: list[np.ndarray] = []
    types, golds, options, views = [], [], [], []
    for record, labels, record_means in zip(encoded, gold, means, strict=True):
        rows_of.append([])
        for j, question in enumerate(record.questions):
            rows_of[-1].append(len(vecs))
            vecs.append(record_means[j])
            types.append(question.question_type)
            golds.append(labels[j])
            options.append(table.lookup(record, j))
            views.append(False)
            gold_id = question.option_ids[labels[j]] if labels[j] >= 0 else None
            if (universe and question.question_type == TYPE_IDS["choice"] and gold_id in universe
                    and set(question.option_ids) <= set(universe) and len(question.option_ids) < len(universe)):
                vecs.append(record_means[j])
                types.append(question.question_type)
                assert gold_id is not None  # it is in the universe
                golds.append(order.index(gold_id))
                options.append(universe_ids)
                views.append(True)
    width = max(len(o) for o in options)
    padded = torch.full((len(options), width), -1, dtype=torch.long)
    for n, o in enumerate(options):
        padded[n, : len(o)] = torch.tensor(o)
    return Questions(torch.from_numpy(np.stack(vecs)), torch.tensor(types), torch.tensor(golds), padded,
                     torch.tensor(views)), rows_of


def _units(rows_of: list[list[int]], n_examples: int, encoded: Sequence[EncodedRecord], twins: Sequence[Twin],
           total_rows: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Units of rows that train together (a record's questions and views; a twin's two records) and the twin row
    pairs; the records are ``n_examples`` examples, then the twins' two records each, then any others."""
    starts = [rows[0] for rows in rows_of] + [total_rows]  # a record's rows (questions, views) are contiguous
    units = [list(range(a, b)) for a, b in itertools.pairwise(starts)]
    pairs: list[tuple[int, int]] = []
    merged: list[list[int]] = units[:n_examples]
    for t, twin in enumerate(twins):
        i, j = n_examples + 2 * t, n_examples + 2 * t + 1
        where = {q.question_id: k for k, q in enumerate(encoded[j].questions)}
        pairs += [(rows_of[i][k], rows_of[j][where[twin.same[q.question_id]]])
                  for k, q in enumerate(encoded[i].questions) if q.question_id in twin.same]
        merged.append(units[i] + units[j])
    return merged + units[n_examples + 2 * len(twins):], pairs  # records after the twins train on their own


@dataclass(frozen=True)
class Split:
    """A run's units (lists of question rows that train together), cut into validation and fit."""

    rows_of: list[list[int]]  # per record, the rows of its questions (views are extra rows, not listed)
    val: list[list[int]]
    fit: list[list[int]]
    twin_pairs: list[tuple[int, int]]

    @property
    def units(self) -> int:
        return len(self.val) + len(self.fit)

    @functools.cached_property
    def _starts(self) -> list[int]:
        return [rows[0] for rows in self.rows_of]

    def record_of(self, row: int) -> int:
        """The record a row belongs to (a record's rows, its questions then their views, are contiguous)."""
        return bisect.bisect_right(self._starts, row) - 1


def split_units(tokenizer: ReleaseTokenizer, encoded: Sequence[EncodedRecord], gold: Sequence[Sequence[int]],
                table: LexicalTable, universe: Sequence[str], n_examples: int, twins: Sequence[Twin],
                rng: random.Random, validation: float) -> Split:
    """The units and their validation split (``rng`` shuffles them); it needs only each record's row count, so it
    runs before any span mean is computed."""
    placeholder = [np.zeros((len(r.questions), 1), dtype=np.float32) for r in encoded]
    laid_out, rows_of = build_questions(tokenizer, encoded, gold, placeholder, table, universe)
    units, twin_pairs = _units(rows_of, n_examples, encoded, twins, len(laid_out.gold))
    rng.shuffle(units)
    n_val = int(len(units) * validation)
    return Split(rows_of, units[:n_val], units[n_val:], twin_pairs)
