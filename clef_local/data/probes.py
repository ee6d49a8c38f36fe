"""Fixed probe requests drawn from the packaged BANKING77 / NLU++ data: export validation
(:mod:`clef_local.export.validate`, the ONNX check), ``drift``'s built-in set and, from the training splits, GPTQ's
calibration requests. Here, beside the data, so that a reader of probes does not import the export package.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

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
