"""Labelled sources beyond BANKING77 and NLU++ (clef_local/data/README.md): the VADER sentiment lexicon
(:func:`vader_words`, MIT) and the project's own severity ladders (:func:`severity_ladders`; ``train`` ladders for
training, ``heldout`` for evaluation only), both read from the package.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache

from clef_local.data.datasets import packaged_datasets_dir

# Single plain words only: the lexicon also rates emoticons and slang abbreviations, which make no sentence.
_WORD = re.compile(r"[a-z]{4,}")
# Ten raters' standard deviation above this means they disagreed on the word: no clean label.
MAX_RATING_SD = 1.0


@dataclass(frozen=True)
class Ladder:
    """One situation in messages of rising severity (``levels[0]`` minor … ``levels[-1]`` an emergency)."""

    domain: str
    levels: tuple[str, ...]


@cache
def vader_words(min_abs: float = 0.5) -> tuple[tuple[str, float], ...]:
    """``(word, mean rating)`` of the VADER lexicon's plain words whose raters agreed (sd ≤ ``MAX_RATING_SD``) and
    whose mean is at least ``min_abs`` away from neutral, sorted by word."""
    text = (packaged_datasets_dir() / "vader" / "vader_lexicon.txt").read_text(encoding="utf-8")
    out = []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or not _WORD.fullmatch(parts[0]):
            continue
        mean, sd = float(parts[1]), float(parts[2])
        if sd <= MAX_RATING_SD and abs(mean) >= min_abs:
            out.append((parts[0], mean))
    return tuple(sorted(out))


@cache
def _cases() -> dict:
    return json.loads((packaged_datasets_dir() / "cases" / "severity.json").read_text(encoding="utf-8"))


def severity_domains() -> dict[str, str]:
    """The ladders' domains: ``{id: description}``."""
    return dict(_cases()["domains"])


def severity_ladders(split: str) -> list[Ladder]:
    """The ``train`` or ``heldout`` ladders."""
    if split not in ("train", "heldout"):
        raise ValueError(f"severity ladders come in splits train and heldout, got {split!r}")
    return [Ladder(item["domain"], tuple(item["levels"])) for item in _cases()["ladders"] if item["split"] == split]
