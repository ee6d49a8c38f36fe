"""Training records: labelled requests encoded as the runtime encodes them, with each question's gold option, and
the units (a record, or a twin's two records) that batches are made of."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch

from clef_local.data.datasets import Example, Twin
from clef_local.formats.release import read_json
from clef_local.runtime.encoding import EncodedRecord, encode_request
from clef_local.runtime.schema import validate_request
from clef_local.runtime.tokenizer import ReleaseTokenizer


def gold_index(question_type: int, option_ids: Sequence[str], label: object) -> int:
    """The gold option's index; ``-1`` for a question without a label (it then only counts in twin consistency)."""
    if label is None:
        return -1
    if question_type == 0:
        return 0 if label else 1  # noul options are true, false
    return list(option_ids).index(str(label))


def max_length(backbone_dir: Path) -> int:
    """The longest request (in tokens) the backbone in ``backbone_dir`` reads: its ``max_position_embeddings``."""
    config = read_json(backbone_dir / "config.json")
    return int((config.get("text_config") or config).get("max_position_embeddings", 16384))


def encode_examples(tokenizer: ReleaseTokenizer, examples: Sequence[Example], max_length: int
                    ) -> list[tuple[EncodedRecord, list[int]]]:
    """Each example's encoding and the gold option index of each question (model order)."""
    out = []
    for example in examples:
        encoded = encode_request(tokenizer, validate_request(example.request), max_length=max_length)
        gold = [gold_index(q.question_type, q.option_ids, example.labels.get(q.question_id))
                for q in encoded.questions]
        out.append((encoded, gold))
    return out


def training_records(examples: Sequence[Example], twins: Sequence[Twin] = (),
                     canonical: Sequence[Example] = ()) -> list[Example]:
    """The records a run encodes, in the order its caches and units index them: ``examples``, each twin's two
    records, then ``canonical``."""
    return [*examples, *(e for twin in twins for e in (twin.first, twin.second)), *canonical]


def encode_records(tokenizer: ReleaseTokenizer, records: Sequence[Example], backbone_dir: Path
                   ) -> tuple[list[EncodedRecord], list[list[int]]]:
    """:func:`encode_examples` at ``backbone_dir``'s :func:`max_length`, as two lists: the encodings and each
    record's gold option indices."""
    pairs = encode_examples(tokenizer, records, max_length(backbone_dir))
    return [e for e, _ in pairs], [g for _, g in pairs]


def output_embedding(backbone_dir: Path, backbone_config: dict, device: str) -> torch.Tensor:
    """The backbone's output-embedding matrix (float32, no gradient): the rows the options' lexical vectors read."""
    from clef_local.backends.torch_backend import TorchBackbone

    return TorchBackbone(backbone_dir, backbone_config, device=device, dtype=torch.float32).output_embedding.detach()


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


def twin_rows(items: Sequence[int], encoded: Sequence[EncodedRecord],
              twins_of: dict[int, tuple[int, dict[str, str]]]) -> list[tuple[int, int]]:
    """Row pairs (first, second) in a batch's logits (records ``items``, their questions in order) for every twin
    question whose partner is in the batch; ``twins_of``: a twin's first record -> (its second, the id map)."""
    offsets, row = {}, 0
    for i in items:
        offsets[i] = row
        row += len(encoded[i].questions)
    pairs = []
    for i in items:
        if i in twins_of and twins_of[i][0] in offsets:
            j, same = twins_of[i]
            where = {q.question_id: k for k, q in enumerate(encoded[j].questions)}
            pairs += [(offsets[i] + k, offsets[j] + where[same[q.question_id]])
                      for k, q in enumerate(encoded[i].questions) if q.question_id in same]
    return pairs


def partner_pairs(rows: Sequence[int], partner: dict[int, int]) -> list[tuple[int, int]]:
    """Positions in ``rows`` of every twin pair (``partner``: question row -> its twin's row) whose both rows are
    there."""
    at = {r: n for n, r in enumerate(rows)}
    return [(at[a], at[b]) for a, b in partner.items() if a in at and b in at]


def units_to_batches(units: Sequence[Sequence[int]], batch_records: int,
                     lengths: Sequence[int] | None = None, pool: int = 50) -> list[list[int]]:
    """Units (a record, or a twin's two records) grouped into batches of about ``batch_records`` records.

    With ``lengths``, units are sorted by length within pools of ``pool`` batches (so a batch pads to a similar
    length, not to the longest record in the data) and the batches are shuffled back; the order
    stays random from epoch to epoch because ``units`` arrive shuffled.
    """
    if lengths is not None:
        size = pool * batch_records
        units = [u for start in range(0, len(units), size)
                 for u in sorted(units[start : start + size], key=lambda u: max(lengths[i] for i in u))]
    batches: list[list[int]] = [[]]
    for unit in units:
        if len(batches[-1]) + len(unit) > batch_records and batches[-1]:
            batches.append([])
        batches[-1].extend(unit)
    batches = [b for b in batches if b]
    if lengths is not None:
        random.Random(len(units) + sum(batches[0])).shuffle(batches)
    return batches
