"""The request path stays short: a cold ``decide`` with ``load``'s defaults runs the backbone once, at most five of
our frames below ``ClefModel.decide`` (decide → run → logits → pass → forward, docs/architecture.md §4); the state
cache, where asked for, is a lookup inside the same pass."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import clef_local
from clef_local.model import ClefModel

REQUEST = {"model": "m", "state": "I was charged twice for my coffee this morning.",
           "questions": {"refund": {"type": "noul", "instructions": "Does the customer want money back?"},
                         "team": {"type": "choice", "criteria": {"cards": "Card payments", "transfers": None}}}}
PACKAGE = str(Path(clef_local.__file__).parent)


def trace_forwards(model: ClefModel, request: dict[str, Any]) -> list[list[str]]:
    """For each call of the backbone's text model ``forward`` during ``model.decide(request)``: the clef_local
    frames between it and ``ClefModel.decide`` (innermost first; decide included)."""
    text_model = model.backend.backbone.text_model
    target = inspect.unwrap(type(text_model).forward).__code__
    chains: list[list[str]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code is not target:
            return
        chain, f = [], frame.f_back
        while f is not None:
            if f.f_code.co_filename.startswith(PACKAGE):
                chain.append(f.f_code.co_qualname)
            if f.f_code is ClefModel.decide.__code__:
                break
            f = f.f_back
        chains.append(chain)

    sys.setprofile(profile)
    try:
        model.decide(request)
    finally:
        sys.setprofile(None)
    return chains


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen"])
def test_a_cold_decide_is_one_forward_five_frames_deep(name: str, request: pytest.FixtureRequest) -> None:
    model = clef_local.load(request.getfixturevalue(name), dtype="float32")
    assert not model.state_cache.enabled  # one-shot by default: no cache to pay for
    chains = trace_forwards(model, REQUEST)
    assert len(chains) == 1, chains  # the backbone ran once
    assert chains[0] == ["TorchBackbone.forward", "hidden_states", "TorchBackend.logits", "ClefModel.run",
                         "ClefModel.decide"]


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen"])
def test_the_state_cache_is_a_lookup_inside_the_pass(name: str, request: pytest.FixtureRequest) -> None:
    model = clef_local.load(request.getfixturevalue(name), dtype="float32", state_cache="16MiB")
    cold = trace_forwards(model, REQUEST)  # a miss: the state pass, then the schema after it
    assert [len(chain) for chain in cold] == [5, 5]
    other = {**REQUEST, "questions": {"urgent": {"type": "noul"}}}
    hit = trace_forwards(model, other)  # a hit: only the schema's tokens run
    assert len(hit) == 1 and hit[0] == cold[0]
    stats = model.state_cache.stats()
    assert (stats.misses, stats.hits, stats.stores) == (1, 1, 1)
