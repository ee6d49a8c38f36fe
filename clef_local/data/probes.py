"""Fixed probe requests drawn from the packaged BANKING77 / NLU++ / VADER data. :func:`validation_probes`: export
validation's probe set (:mod:`clef_local.export.validate`, the ONNX check) and ``drift``'s built-in set, every kind
of request mixed in each run of 8; :func:`probe_requests`: short messages grouped by kind, from the test or (GPTQ's
calibration, mixed's selection) the training splits. Here, beside the data, so that a reader of probes does not
import the export package.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clef_local.data import probe_kinds
from clef_local.data.datasets import banking77_intents, banking77_request, banking77_rows, nlupp_intents, nlupp_rows

SCORE_QUESTION = ("How urgent is the customer's request?",
                  ["not urgent", "can wait a few days", "should be handled today", "needs action right now"])
CARD_QUESTION = "Is the customer's message about a card (a debit or credit card)?"
PROBE_SPLITS = {"test": range(16, 20), "train": range(0, 16)}  # the BANKING77 split and its NLU++ folds


def probe_requests(n: int = 64, seed: int = 0, root: Path | None = None, *, split: str = "test"
                   ) -> list[dict[str, Any]]:
    """``n`` SystemOne requests from ``clef_local.data.datasets``, the same for the same ``seed``.

    Half are BANKING77 messages as a choice over 8–16 intents (the gold one included), a quarter NLU++ banking
    messages with 4 noul questions each, the rest BANKING77 messages with a score question (urgency, 4 levels) and
    a noul question. ``split`` "test" (validation) draws BANKING77 test and NLU++ folds 16–19; "train"
    (calibration) BANKING77 train and folds 0–15. ``root`` overrides the datasets folder
    (:func:`~clef_local.data.datasets.datasets_dir`); FileNotFoundError when the datasets cannot be found.
    """
    if split not in PROBE_SPLITS:
        raise ValueError(f"split must be one of {', '.join(PROBE_SPLITS)}, not {split!r}")
    rng = random.Random(seed)
    intents = list(banking77_intents(root))
    rows = banking77_rows(split, root)
    n_choice, n_noul = n // 2, n // 4
    requests = []
    for text, gold in rng.sample(rows, n_choice):
        options = [gold, *rng.sample([i for i in intents if i != gold], rng.randint(7, 15))]
        rng.shuffle(options)
        requests.append(banking77_request(text, options))
    questions = nlupp_intents(root)
    names = sorted(questions)
    for text, _gold in rng.sample(nlupp_rows(PROBE_SPLITS[split], root), n_noul):
        chosen = rng.sample(names, 4)
        requests.append({"model": "clef-local", "state": text,
                         "questions": {q: {"type": "noul", "instructions": questions[q]} for q in chosen}})
    for text, _intent in rng.sample(rows, n - n_choice - n_noul):
        requests.append({"model": "clef-local", "state": text, "questions": {
            "urgency": {"type": "score", "instructions": SCORE_QUESTION[0], "criteria": list(SCORE_QUESTION[1])},
            "about_card": {"type": "noul", "instructions": CARD_QUESTION}}})
    return requests


# One block of validation_probes: every kind once (short choice twice), in a seeded order; the two costly kinds take
# turns, one per block: a long state in even blocks (its slot a short request in odd ones), a long option list in odd
# blocks (a short choice in even ones); the last slot alternates noul / score between blocks, and is an image request
# when the model reads images.
BLOCK = ("choice", "choice", "choice_long", "noul", "score", "json", "long", "short")
# The long states' target tokens, one per 16 requests: a share that shows what a long context does to the verdict
# without paying for it on every look — the questions, not the tokens, are what a bound needs, and a long state
# holds no more questions than a short one. 1K–4K in the first 64 (the 64 then cost ~1.7x the short-only set's
# tokens, long option lists included); the 8K and 16K states come late (about requests 180 and 245), where only a
# verdict that needs that many probes (int8's 1% flip limit) pays for them (16K tokens through a 4B backbone are
# ~130 TFLOP, minutes on a CPU).
LONG_FIRST = (1024, 2048, 1024, 4096)
LONG_LATER = (1024, 2048, 1024, 4096, 1024, 2048, 1024, 8192, 1024, 2048, 1024, 16384)


def validation_probes(n: int = 64, seed: int = 0, *, vision: bool = False, root: Path | None = None
                      ) -> list[dict[str, Any]]:
    """``n`` validation probe requests, the same for the same ``seed``, each prefix of 8 a mix of kinds.

    Built in blocks of 8 requests in a seeded order (:data:`BLOCK`): short BANKING77 messages as a choice over 8–16
    intents, an NLU++ message with 4 noul questions, a message with an urgency score and a noul, a JSON state (an
    account event, a disputed transaction or a list of events) with all three types, and one costly request taking
    turns: in even blocks a customer's conversation log asked about as a whole (1K–4K tokens in the first 64 requests,
    :data:`LONG_FIRST`; 1K–16K after them, :data:`LONG_LATER`), in odd ones a choice over 40–77 intents (a long
    option list); with ``vision`` the short noul / score slots are image requests (one or two small synthetic PNGs as
    data URIs, questions naming ``<image 1>``). A longer list begins with the shorter one
    (``validation_probes(64) == validation_probes(128)[:64]``). Drawn from BANKING77 test and NLU++ folds 16–19
    (``root``: another datasets folder); FileNotFoundError when they cannot be found.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, not {n}")
    pools = probe_kinds.Pools.load(seed, root)
    makers: dict[str, Callable[[], dict[str, Any]]] = {
        "choice": lambda: probe_kinds.choice_request(pools),
        "choice_long": lambda: probe_kinds.choice_request(pools, 40, 77),
        "noul": lambda: probe_kinds.noul_request(pools),
        "score": lambda: probe_kinds.score_request(pools),
        "json": lambda: probe_kinds.json_request(pools),
        "vision": lambda: probe_kinds.vision_request(pools)}
    requests: list[dict[str, Any]] = []
    for block in range(-(-n // 8)):
        kinds = list(BLOCK)
        pools.rng.shuffle(kinds)
        for kind in kinds:
            if kind == "long" and block % 2 == 0:
                pair = block // 2
                length = LONG_FIRST[pair] if pair < len(LONG_FIRST) else LONG_LATER[(pair - len(LONG_FIRST)) %
                                                                                   len(LONG_LATER)]
                requests.append(probe_kinds.long_state_request(pools, length))
            elif kind == "choice_long" and block % 2 == 0:  # one expensive request per block: the long state
                requests.append(makers["choice"]())
            elif kind in ("short", "long"):  # a block's two short slots: one noul, one score
                noul = bool(block % 2) != (kind == "long")
                requests.append(makers["vision" if vision else ("noul" if noul else "score")]())
            else:
                requests.append(makers[kind]())
    return requests[:n]


def long_state_requests(n: int, tokens: int, seed: int = 0, *, count_tokens: Callable[[str], int] | None = None,
                        root: Path | None = None) -> list[dict[str, Any]]:
    """``n`` requests whose state is a customer's conversation log of about ``tokens`` tokens (at least that many
    by ``count_tokens``, a tokenizer's count of a text, when given), each with a choice over 8–16 intents, two noul
    questions and a score (:func:`clef_local.data.probe_kinds.long_state_request`)."""
    pools = probe_kinds.Pools.load(seed, root)
    return [probe_kinds.long_state_request(pools, tokens, count_tokens) for _ in range(n)]
