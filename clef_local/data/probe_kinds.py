"""The kinds of probe request beyond a short message (:func:`clef_local.data.probes.validation_probes`): long
states (a customer's conversation log of 1K–16K tokens), JSON states (an account event, a disputed transaction, a
list of account events), long option lists (40–77 BANKING77 intents) and images (small synthetic PNGs).

Every text comes from the packaged datasets (BANKING77, NLU++, the VADER lexicon; clef_local/data/README.md); the
framing around it (timestamps, field names, amounts) is generated from the seed. Nothing here needs a tokenizer:
lengths are aimed with :data:`CHARS_PER_TOKEN`, or hit exactly with a ``count_tokens`` callable.
"""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_local.data.datasets import (
    banking77_intents,
    banking77_request,
    banking77_rows,
    intent_description,
    nlupp_intents,
    nlupp_rows,
)

MODEL = "clef-local"
SCORE_QUESTION = ("How urgent is the customer's request?",
                  ["not urgent", "can wait a few days", "should be handled today", "needs action right now"])
CARD_QUESTION = "Is the customer's message about a card (a debit or credit card)?"
# Characters per token of a conversation log below, measured with the demo model's tokenizer (SmolLM's BPE; Qwen's
# splits digits and English words alike): 2.6-2.7 over 1K-16K-token logs. A log aimed without a tokenizer lands
# within about ±10% of its target; count_tokens= makes it at least the target, by less than one message more.
CHARS_PER_TOKEN = 2.65
CURRENCIES = ("GBP", "EUR", "USD", "PLN", "CHF")
CHANNELS = ("app", "web", "phone", "branch", "email")
STATUSES = ("pending", "completed", "declined", "reverted", "on_hold")
CATEGORIES = ("groceries", "travel", "atm_withdrawal", "online_shopping", "transfer", "restaurants", "utilities")
IMAGE_SUBJECTS = {"card": "a payment card", "receipt": "a receipt or an invoice",
                  "screenshot": "a screenshot of the banking app", "document": "an identity document", "other": None}
# (width, height) of the synthetic images: small, so that each costs the vision tower few tokens, in three aspects
IMAGE_SIZES = ((64, 64), (96, 48), (48, 112), (128, 96), (40, 40))


@dataclass
class Pools:
    """The packaged rows a probe list draws from, each shuffled once by the list's seed and then taken in order
    (cycled), so that a longer list begins with the shorter one and rows repeat only after a whole pool."""

    rng: random.Random
    intents: tuple[str, ...]
    nlupp_questions: dict[str, str]
    banking_rows: Iterator[tuple[str, str]]
    nlupp_rows: Iterator[tuple[str, frozenset[str]]]

    @classmethod
    def load(cls, seed: int, root: Path | None = None, *, nlupp_folds: Sequence[int] = range(16, 20),
             split: str = "test") -> Pools:
        """BANKING77 ``split`` and the NLU++ banking ``nlupp_folds`` from ``root`` (None: the datasets folder)."""
        rng = random.Random(seed)
        banking = banking77_rows(split, root)
        nlupp = nlupp_rows(nlupp_folds, root)
        rng.shuffle(banking)
        rng.shuffle(nlupp)
        return cls(rng, banking77_intents(root), nlupp_intents(root), _cycle(banking), _cycle(nlupp))

    def banking(self) -> tuple[str, str]:
        """The next BANKING77 ``(text, intent)``."""
        return next(self.banking_rows)

    def nlupp(self) -> tuple[str, frozenset[str]]:
        """The next NLU++ banking ``(text, intents)``."""
        return next(self.nlupp_rows)

    def options(self, gold: str, low: int, high: int) -> list[str]:
        """``gold`` and ``low``–``high`` - 1 other intents, shuffled (at most all 77)."""
        count = min(self.rng.randint(low, high), len(self.intents))
        options = [gold, *self.rng.sample([i for i in self.intents if i != gold], count - 1)]
        self.rng.shuffle(options)
        return options


def _cycle(rows: list[Any]) -> Iterator[Any]:
    while True:
        yield from rows


def _score() -> dict[str, Any]:
    return {"type": "score", "instructions": SCORE_QUESTION[0], "criteria": list(SCORE_QUESTION[1])}


def choice_request(pools: Pools, low: int = 8, high: int = 16) -> dict[str, Any]:
    """A BANKING77 message as a choice over ``low``–``high`` intents, the gold one among them (40–77: a long
    option list)."""
    text, gold = pools.banking()
    return banking77_request(text, pools.options(gold, low, high))


def noul_request(pools: Pools, questions: int = 4) -> dict[str, Any]:
    """An NLU++ banking message with ``questions`` of its ontology's yes/no questions."""
    text, _gold = pools.nlupp()
    chosen = pools.rng.sample(sorted(pools.nlupp_questions), questions)
    return {"model": MODEL, "state": text,
            "questions": {q: {"type": "noul", "instructions": pools.nlupp_questions[q]} for q in chosen}}


def score_request(pools: Pools) -> dict[str, Any]:
    """A BANKING77 message with the urgency score and the card noul."""
    text, _intent = pools.banking()
    return {"model": MODEL, "state": text, "questions": {
        "urgency": _score(), "about_card": {"type": "noul", "instructions": CARD_QUESTION}}}


def _money(rng: random.Random) -> float:
    return round(-rng.lognormvariate(3.5, 1.2), 2)


def json_state(pools: Pools, text: str) -> dict[str, Any] | list[Any]:
    """A JSON state carrying the customer's message ``text``: an account event, a disputed transaction, or a list
    of account events ending in the message (one of the three, by the seed)."""
    from clef_local.data.sources import vader_words

    rng = pools.rng
    shape = rng.randrange(3)
    when = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}Z"
    if shape == 0:
        words = vader_words()
        return {"event": "support_message", "received": when, "channel": rng.choice(CHANNELS),
                "customer": {"id": f"cus-{rng.randrange(16**6):06x}", "tenure_months": rng.randint(1, 180),
                             "verified": rng.random() < 0.8},
                "message": text, "sentiment_tags": [w for w, _ in rng.sample(words, rng.randint(1, 3))]}
    if shape == 1:
        return {"transaction": {"id": f"tx-{rng.randrange(16**8):08x}", "booked": when, "amount": _money(rng),
                                "currency": rng.choice(CURRENCIES), "status": rng.choice(STATUSES),
                                "category": rng.choice(CATEGORIES), "card_last4": f"{rng.randrange(10**4):04d}"},
                "dispute": {"opened": True, "customer_note": text, "previous_disputes": rng.randint(0, 3)}}
    events: list[Any] = [{"type": rng.choice(("card_payment", "transfer_out", "top_up", "fee")), "amount": _money(rng),
                          "currency": rng.choice(CURRENCIES), "status": rng.choice(STATUSES)}
                         for _ in range(rng.randint(2, 5))]
    return [*events, {"type": "message", "at": when, "text": text}]


def json_request(pools: Pools) -> dict[str, Any]:
    """A JSON state (:func:`json_state`) with a choice over 8–16 intents, the card noul and the urgency score."""
    text, gold = pools.banking()
    request = banking77_request(text, pools.options(gold, 8, 16))
    request["state"] = json_state(pools, text)
    request["questions"]["intent"]["instructions"] = ("Which banking intent does the customer's message in this "
                                                     "record express?")
    request["questions"].update(about_card={"type": "noul", "instructions": CARD_QUESTION}, urgency=_score())
    return request


def conversation_log(pools: Pools, tokens: int, count_tokens: Callable[[str], int] | None = None
                     ) -> tuple[str, str]:
    """A customer's support conversation log of about ``tokens`` tokens: BANKING77 and NLU++ messages with
    timestamps, each BANKING77 one followed by the agent's tag (its intent); and the intent of the last message.

    Without ``count_tokens`` the length is aimed at with :data:`CHARS_PER_TOKEN`; with it (a tokenizer's count of
    a text) lines are added until the log has at least ``tokens`` tokens, and it ends within one message of that."""
    rng = pools.rng
    lines = [f"Support conversation log, account ending {rng.randrange(10**4):04d}, oldest first."]
    day, minute, last = 1, rng.randint(0, 600), ""

    def grow(chars: int) -> None:
        nonlocal day, minute, last
        size = 0
        while size < chars:
            minute += rng.randint(1, 240)
            day, minute = day + minute // 1440, minute % 1440
            stamp = f"[day {day}, {minute // 60:02d}:{minute % 60:02d}]"
            if rng.random() < 0.7:
                text, last = pools.banking()
                new = [f"{stamp} customer: {text}", f"{stamp} agent: tagged '{intent_description(last)}'"]
            else:
                new = [f"{stamp} customer: {pools.nlupp()[0]}"]
            lines.extend(new)
            size += sum(len(line) + 1 for line in new)

    # with a count: aim at half (another tokenizer may take twice the tokens per character), then add 90% of what is
    # missing at the characters per token measured so far, down to a message at a time
    grow(int(tokens * CHARS_PER_TOKEN * (1.0 if count_tokens is None else 0.5)) - len(lines[0]))
    if count_tokens is not None:
        while (have := count_tokens(text := "\n".join(lines))) < tokens:
            grow(int((tokens - have) * len(text) / max(have, 1) * 0.9))
    if not last:  # a short log of NLU++ lines only: end on a message with a known intent
        text, last = pools.banking()
        lines.append(f"[day {day}, 23:59] customer: {text}")
    return "\n".join(lines), last


def long_state_request(pools: Pools, tokens: int, count_tokens: Callable[[str], int] | None = None
                       ) -> dict[str, Any]:
    """A conversation log of about ``tokens`` tokens (:func:`conversation_log`) asked about as a whole: the last
    message's intent (a choice over 8–16), two NLU++ yes/no questions about any point of it, and the urgency."""
    state, last = conversation_log(pools, tokens, count_tokens)
    questions: dict[str, Any] = {"last_intent": {
        "type": "choice", "instructions": "Which banking intent does the customer's last message express?",
        "criteria": dict.fromkeys(pools.options(last, 8, 16))}}
    for name in pools.rng.sample(sorted(pools.nlupp_questions), 2):
        questions[f"ever_{name}"] = {"type": "noul", "instructions": f"At any point in the conversation: "
                                                                      f"{pools.nlupp_questions[name]}"}
    questions["urgency"] = _score()
    return {"model": MODEL, "state": state, "questions": questions}


def synthetic_png(width: int, height: int, seed: int) -> bytes:
    """A PNG's bytes: smooth colour gradients plus noise, the same for the same arguments (so that resizing and
    patches carry signal; no image file ships with the package)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    phase = rng.uniform(0, 1, 3)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1)
    base = (base + phase) % 1.0 * 200
    pixels = np.clip(base + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def png_data_uri(data: bytes) -> str:
    """A PNG as a ``data:`` URI, a form every request path takes (and JSON can carry)."""
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def vision_request(pools: Pools) -> dict[str, Any]:
    """A BANKING77 message with one or two small synthetic images and questions naming ``<image 1>``: what it
    shows (a choice), how legible it is (a score), whether it supports the message (a noul)."""
    rng = pools.rng
    text, _intent = pools.banking()
    count = rng.randint(1, 2)
    images = [png_data_uri(synthetic_png(*rng.choice(IMAGE_SIZES), seed=rng.randrange(2**31))) for _ in range(count)]
    questions: dict[str, Any] = {
        "shows": {"type": "choice", "instructions": "What does <image 1> show?", "criteria": dict(IMAGE_SUBJECTS)},
        "legible": {"type": "score", "instructions": "How legible is <image 1>?",
                    "criteria": ["unreadable", "poor", "fine", "sharp"]},
        "supports": {"type": "noul", "instructions": "Does <image 1> support what the customer's message says?"}}
    if count == 2:
        questions["same"] = {"type": "noul", "instructions": "Do <image 1> and <image 2> show the same thing?"}
    state: str | dict[str, Any] = text if rng.random() < 0.5 else {"message": text, "attachments": count}
    return {"model": MODEL, "state": state, "images": images, "questions": questions}


__all__ = ["CHARS_PER_TOKEN", "Pools", "choice_request", "conversation_log",
           "json_request", "json_state", "long_state_request", "noul_request", "png_data_uri", "score_request",
           "synthetic_png", "vision_request"]
