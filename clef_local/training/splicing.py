"""Spliced training records: one row's state, another cached record's schema, for the cost of a state-only pass.

A request's state comes right after the fixed prefix, and causal attention keeps the state's tokens blind to the
schema that follows: their final hidden states are those of a pass over ``prefix + state`` alone (~50 tokens for a
BANKING77 message, against ~1,700 for the whole 77-option request). The schema's tokens do see the state, but
faintly: another message moves them by ~4% (their option-span means by ~2%; renaming, reordering or adding
questions moves them 3–9%).

So the schema hidden states of a cached record can be joined to the exact state hidden states of any other row of
its dataset, and its questions relabelled from that row's gold (``DemoExample.rules``): new (state, schema) pairs
at ~1/35 of a real pass. It also closes the shortcut a head otherwise learns first — reading the state off the
schema tokens' faint echo of it — and leaves the state's own tokens, which no renaming, reordering or added
question can move. Exact records stay in every epoch, so the head still sees real prompts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clef_local.runtime.encoding import PREFIX, EncodedRecord, encode_request, render
from clef_local.runtime.schema import validate_request
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.hidden_cache import cache_hidden_states


def state_records(tokenizer: ReleaseTokenizer, texts: Sequence[str]) -> list[EncodedRecord]:
    """``prefix + state`` of each text as a question-less record, tokenized piece by piece as a request is."""
    prefix = tokenizer.encode_pieces([PREFIX])[0]
    pieces = tokenizer.encode_pieces([render(text) for text in texts])
    return [EncodedRecord(tuple(prefix + ids), (), state_tokens=len(ids), state_start=len(prefix)) for ids in pieces]


@dataclass(frozen=True)
class Spliced:
    """One epoch's spliced records: encodings, where each one's hidden states come from, and gold indices."""

    encoded: list[EncodedRecord]
    parts: list[tuple[int, int]]  # (state index in the bank, donor index)
    gold: list[list[int]]


class Splicer:
    """Draws spliced records from donors (cached exact records with label rules) and a bank of state hidden states.

    ``donors``: ``(index, example)`` of the exact records whose ``source`` has states; ``states``: per source, the
    ``(text, gold)`` rows to draw from, whose hidden states are ``bank[source][row]``.
    """

    def __init__(self, tokenizer: ReleaseTokenizer, max_length: int, donors: Sequence[tuple[int, Any]],
                 encoded: Sequence[EncodedRecord], hidden: Sequence[torch.Tensor],
                 states: Mapping[str, Sequence[tuple[str, Any]]], bank: Mapping[str, Sequence[torch.Tensor]],
                 gold_index: Callable[[int, Sequence[str], object], int]) -> None:
        self.tokenizer, self.max_length, self.gold_index = tokenizer, max_length, gold_index
        self.donors = [(i, example) for i, example in donors if example.source in states]
        if not self.donors:
            raise ValueError(f"no training record can be spliced: none has a source among {sorted(states)}")
        self.encoded, self.hidden, self.states = encoded, hidden, states
        self.offsets: dict[str, int] = {}
        self.bank: list[torch.Tensor] = []
        start = 0
        for source, rows in states.items():  # one flat bank, each source's rows at an offset
            self.offsets[source] = start
            self.bank.extend(bank[source])
            start += len(rows)

    def draw(self, count: int, rng: random.Random) -> Spliced:
        encoded, parts, gold = [], [], []
        for _ in range(count):
            index, donor = rng.choice(self.donors)
            rows = self.states[donor.source]
            row = rng.randrange(len(rows))
            text, row_gold = rows[row]
            request = {**donor.request, "state": text}
            record = encode_request(self.tokenizer, validate_request(request),
                                    max_length=self.max_length)
            labels = donor.relabel(row_gold)
            encoded.append(record)
            parts.append((self.offsets[donor.source] + row, index))
            gold.append([self.gold_index(q.question_type, q.option_ids, labels.get(q.question_id))
                         for q in record.questions])
        return Spliced(encoded, parts, gold)

    def hidden_states(self, state: int, donor: int) -> torch.Tensor:
        """The state's own hidden states followed by the donor's schema hidden states."""
        record = self.encoded[donor]
        schema = self.hidden[donor][record.state_start + record.state_tokens :]
        return torch.cat([self.bank[state], schema])


class EpochHidden:
    """The hidden states of an epoch's records by index: exact records first, then the spliced ones."""

    def __init__(self, exact: Sequence[torch.Tensor], splicer: Splicer | None, spliced: Spliced | None) -> None:
        self.exact, self.splicer, self.spliced = exact, splicer, spliced

    def __getitem__(self, index: int) -> torch.Tensor:
        if index < len(self.exact):
            return self.exact[index]
        if self.splicer is None or self.spliced is None:
            raise IndexError(f"record {index}: this epoch has {len(self.exact)} records and no spliced ones")
        state, donor = self.spliced.parts[index - len(self.exact)]
        hidden = self.splicer.hidden_states(state, donor)
        if hidden.shape[0] != len(self.spliced.encoded[index - len(self.exact)].input_ids):
            raise RuntimeError(f"spliced record {index}: {hidden.shape[0]} hidden states for "
                               f"{len(self.spliced.encoded[index - len(self.exact)].input_ids)} tokens")
        return hidden


def cache_state_bank(backbone_dir: Path, tokenizer: ReleaseTokenizer, states: Mapping[str, Sequence[tuple[str, Any]]],
                     cache: Path, device: str) -> dict[str, list[torch.Tensor]]:
    """Hidden states of ``prefix + state`` for every row of every source, cached like records are."""
    return {source: cache_hidden_states(backbone_dir, state_records(tokenizer, [t for t, _ in rows]), cache,
                                        device=device)
            for source, rows in states.items()}
