"""Labelled evaluation data as SystemOne requests: BANKING77 (a choice) and NLU++ banking (a noul per intent).

The files ship in the package (CC BY 4.0, ``clef_local/data/README.md``; ``$CLEF_LOCAL_DATASETS`` may name another
folder of the same layout); nothing is downloaded. An :class:`Example` is a request and each question's gold label.
"""

from __future__ import annotations

import csv
import json
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

DATASETS_ENV = "CLEF_LOCAL_DATASETS"  # overrides the packaged datasets folder
BANKING77_INSTRUCTIONS = "Which banking intent does the customer's message express?"
NLUPP_DOMAINS = ("general", "banking")  # the banking folds use these intents (hotels ones never occur there)


def evenly(items: Sequence[Any], n: int | None) -> list[Any]:
    """``n`` items spread evenly over ``items`` (all of them when ``n`` is None or not smaller).

    BANKING77's test split is sorted by intent, so its first 150 rows hold two intents: a limited evaluation must
    sample across the split, not take a prefix.
    """
    if n is None or n >= len(items):
        return list(items)
    return [items[k * len(items) // n] for k in range(n)]


@dataclass(frozen=True)
class Example:
    """One labelled request: ``labels`` maps question id → gold option id / bool / level index."""

    id: str
    request: dict[str, Any]
    labels: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Twin:
    """Two requests that must get the same answers: ``same`` maps a question id of ``first`` to its twin's id.

    Head training uses twins for a consistency term: renaming ids, reordering questions or adding unrelated ones
    must not move any probability (what a SystemOne conformance suite checks).
    """

    first: Example
    second: Example
    same: dict[str, str]


def packaged_datasets_dir() -> Path:
    """The folder inside the installed package that holds ``banking77/`` and ``nlupp/``."""
    packaged = resources.files("clef_local.data")
    if not isinstance(packaged, Path):  # e.g. imported from a zip: the CSV/JSON files are not on disk
        raise FileNotFoundError(f"the packaged datasets are not a folder on disk ({packaged}); set "
                                f"{DATASETS_ENV} to a folder holding banking77/ and nlupp/")
    return packaged


def datasets_dir() -> Path:
    """``$CLEF_LOCAL_DATASETS`` when set, else the datasets packaged with clef-local.

    A ``$CLEF_LOCAL_DATASETS`` without ``banking77/`` is an error rather than a silent fallback, so an override
    that is mistyped does not quietly evaluate on other data.
    """
    override = os.environ.get(DATASETS_ENV)
    root = Path(override) if override else packaged_datasets_dir()
    if not (root / "banking77").is_dir() or not (root / "nlupp").is_dir():
        where = f"{DATASETS_ENV}={override}" if override else f"the packaged folder {root}"
        raise FileNotFoundError(f"BANKING77/NLU++ not found in {where}: it must hold banking77/ and nlupp/")
    return root


@cache
def banking77_intents(root: Path | None = None) -> tuple[str, ...]:
    return tuple(json.loads(((root or datasets_dir()) / "banking77" / "categories.json").read_text()))


def banking77_rows(split: str = "test", root: Path | None = None) -> list[tuple[str, str]]:
    """``(text, intent)`` rows of ``train`` or ``test``."""
    if split not in ("train", "test"):
        raise ValueError(f"BANKING77 split must be train or test, got {split!r}")
    with ((root or datasets_dir()) / "banking77" / f"{split}.csv").open(encoding="utf-8", newline="") as f:
        return [(row["text"], row["category"]) for row in csv.DictReader(f)]


def intent_description(intent: str) -> str:
    """``card_payment_fee_charged`` → ``card payment fee charged``."""
    return intent.replace("_", " ")


def banking77_request(text: str, intents: Sequence[str], *, model: str = "clef-local",
                      qid: str = "intent", describe: bool = False) -> dict[str, Any]:
    """One choice question over ``intents`` (ids are the intent names; descriptions optional)."""
    criteria = {i: (intent_description(i) if describe else None) for i in intents}
    return {"model": model, "state": text,
            "questions": {qid: {"type": "choice", "instructions": BANKING77_INSTRUCTIONS, "criteria": criteria}}}


def banking77_examples(split: str = "test", *, options: int = 77, limit: int | None = None, seed: int = 0,
                       root: Path | None = None) -> list[Example]:
    """BANKING77 rows as choice requests over all 77 intents, or over ``options`` random ones holding the gold."""
    intents = banking77_intents(root)
    rng = random.Random(seed)
    examples = []
    for n, (text, gold) in enumerate(banking77_rows(split, root)[:limit]):
        chosen = intents if options >= len(intents) else [gold, *rng.sample([i for i in intents if i != gold],
                                                                             options - 1)]
        examples.append(Example(f"banking77-{split}-{n}", banking77_request(text, chosen), {"intent": gold}))
    return examples


@cache
def nlupp_intents(root: Path | None = None) -> dict[str, str]:
    """NLU++ intents of the banking folds → their yes/no question (``"is the intent to ...?"``)."""
    ontology = json.loads(((root or datasets_dir()) / "nlupp" / "ontology.json").read_text())["intents"]
    return {name: spec["description"] for name, spec in ontology.items()
            if any(d in NLUPP_DOMAINS for d in spec["domain"]) and "hotels" not in spec["domain"]}


def nlupp_rows(folds: Iterable[int], root: Path | None = None) -> list[tuple[str, frozenset[str]]]:
    """``(text, intents)`` rows of the banking folds (0–19)."""
    rows = []
    for fold in folds:
        for row in json.loads(((root or datasets_dir()) / "nlupp" / "banking" / f"fold{fold}.json").read_text()):
            rows.append((row["text"], frozenset(row.get("intents", []))))
    return rows


def nlupp_examples(folds: Iterable[int] = range(16, 20), *, per_request: int = 8, seed: int = 0,
                   root: Path | None = None) -> list[Example]:
    """NLU++ rows as noul requests: every intent of the ontology asked once per row, ``per_request`` at a time."""
    intents = nlupp_intents(root)
    rng = random.Random(seed)
    examples = []
    for n, (text, gold) in enumerate(nlupp_rows(folds, root)):
        names = list(intents)
        rng.shuffle(names)
        for start in range(0, len(names), per_request):
            chunk = names[start : start + per_request]
            questions = {name: {"type": "noul", "instructions": intents[name]} for name in chunk}
            examples.append(Example(f"nlupp-{n}-{start // per_request}",
                                    {"model": "clef-local", "state": text, "questions": questions},
                                    {name: name in gold for name in chunk}))
    return examples
