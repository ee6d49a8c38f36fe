"""The state cache with images (and video frames, where torchvision works) on the tiny vision release in float32: a
hit equals a cold pass (``state_cache=0``) one by one and in batches mixed with text-only records; the media's pixels
are part of the key; the continuation's rope positions carry the media's offset (docs/format.md §7)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from media_gen import data_uri, image, vision_requests
from request_gen import continued, max_dp, random_questions, shared_state_requests

import clef_local
from clef_local.backends.torch_cache import TorchState
from clef_local.runtime.state_cache import record_state_key, state_key

FLOAT32_BOUND = 1e-5
BASES = vision_requests(20, seed=4)


def _schemas(count: int) -> list[dict[str, Any]]:
    """Each image request asked with 2 or 3 schemas (its own first), base after base: 20 states, 50 requests."""
    rng = random.Random(11)
    out = []
    for i, base in enumerate(BASES[:count]):
        out.append(base)
        out.extend({**base, "questions": random_questions(rng, rng.randint(1, 4))} for _ in range(1 + i % 2))
    return out


REQUESTS = _schemas(len(BASES))
STATES = len(BASES)
TEXT_ONLY = shared_state_requests(["A text-only ticket about a refund.", {"order": 7, "late": True}, "ok"], 3, seed=5)


@pytest.fixture(scope="module")
def cold(tiny_vision: Path) -> clef_local.ClefModel:
    return clef_local.load(tiny_vision, dtype="float32", state_cache=0)


@pytest.fixture(scope="module")
def cold_answers(cold: clef_local.ClefModel) -> list[clef_local.Prediction]:
    return cold.predict(REQUESTS, batch_size=1)


def test_requests_cover_image_counts_sizes_and_schemas() -> None:
    assert len(BASES) >= 20 and len(REQUESTS) == 50
    assert {len(r["images"]) for r in BASES} == {1, 2, 3}
    per_state = [sum(1 for r in REQUESTS if r["images"] is b["images"]) for b in BASES]
    assert set(per_state) == {2, 3}
    assert len({str(r["questions"]) for r in REQUESTS}) > 40  # the schemas differ


def test_media_hits_equal_a_cold_pass(tiny_vision: Path, cold: clef_local.ClefModel,
                                      cold_answers: list[clef_local.Prediction]) -> None:
    model = clef_local.load(tiny_vision, dtype="float32", state_cache="256MiB")
    base = model.backend.backbone.model.model
    towers: list[int] = []
    original = base.get_image_features

    def spy(pixel_values: Any, grid: Any, **kwargs: Any) -> Any:
        towers.append(int(grid.shape[0]))
        return original(pixel_values, grid, **kwargs)

    base.get_image_features = spy
    one_by_one = model.predict(REQUESTS, batch_size=1)
    stats = model.state_cache.stats()
    assert (stats.misses, stats.hits, stats.stores) == (STATES, len(REQUESTS) - STATES, STATES)
    # the vision tower runs once per state, on its miss only (the requests run in length order)
    assert sorted(towers) == sorted(len(b["images"]) for b in BASES)
    worst = max_dp(one_by_one, cold_answers)
    print(f"max |Δp| hit vs cold over {len(REQUESTS)} image requests, one by one: {worst:.2e}")
    assert worst <= FLOAT32_BOUND
    # the states carry Qwen's rope offset: an image takes max(h, w) positions, fewer than its tokens
    offsets = [model.state_cache.get(key).position_offset for key in model.state_cache.sizes()]
    assert len(offsets) == STATES and all(offset < 0 for offset in offsets)
    # the head discriminates (the comparison is not of constants)
    assert max(float(p.max() - p.min()) for a in cold_answers for p in a.probabilities) > 0.05


def test_mixed_batches_of_hits_and_misses_equal_cold(tiny_vision: Path, cold: clef_local.ClefModel,
                                                     cold_answers: list[clef_local.Prediction]) -> None:
    model = clef_local.load(tiny_vision, dtype="float32", state_cache="256MiB")
    model.pad_waste = float("inf")  # one padded batch whatever the lengths, as on an accelerator
    model.predict(REQUESTS[:12], batch_size=1)  # some image states cached first: the batches mix hits and misses
    cached = model.state_cache.stats()
    picks = list(range(6, 26))
    mixed: list[dict[str, Any]] = []
    for k, i in enumerate(picks):
        mixed.append(REQUESTS[i])
        if k % 3 == 0:
            mixed.append(TEXT_ONLY[k // 3])
    before = set(model.state_cache.sizes())
    got = model.predict(mixed, batch_size=8)
    keys = {record_state_key(model.backend.state_identity, p.encoded) for p in got}
    new_states = len(keys - before)
    assert len(keys & before) > 0 and new_states > 2  # hits and misses, media and text-only states
    assert sum(1 for p in got if p.encoded.media is None) == 7
    stats = model.state_cache.stats()
    assert stats.misses - cached.misses == new_states
    assert stats.hits - cached.hits == len(mixed) - new_states
    want = {id(r): cold_answers[i] for i, r in enumerate(REQUESTS)}
    text_cold = cold.predict(TEXT_ONLY, batch_size=1)
    want.update({id(r): a for r, a in zip(TEXT_ONLY, text_cold, strict=True)})
    worst = max_dp(got, [want[id(r)] for r in mixed])
    print(f"max |Δp| hit vs cold over {len(mixed)} mixed requests, batches of 8: {worst:.2e}")
    assert worst <= FLOAT32_BOUND
    # everything cached now: the same batches again are all hits, with the same numbers
    again = model.predict(mixed, batch_size=8)
    assert model.state_cache.stats().hits - stats.hits == len(mixed)
    assert max_dp(again, got) <= FLOAT32_BOUND


def test_the_same_text_with_another_image_is_a_miss(tiny_vision: Path, cold: clef_local.ClefModel) -> None:
    model = clef_local.load(tiny_vision, dtype="float32", state_cache="256MiB")
    first = {"model": "m", "state": "Is the parcel damaged?", "images": [data_uri(image(120, 80, seed=1))],
             "questions": {"damaged": {"type": "noul"},
                           "kind": {"type": "choice", "criteria": {"box": None, "bag": None}}}}
    other = {**first, "images": [data_uri(image(120, 80, seed=2))]}  # same size: same ids, other pixels
    mine, theirs = model.encode(first), model.encode(other)
    assert mine.input_ids == theirs.input_ids and mine.media.digest != theirs.media.digest
    identity = model.backend.state_identity
    assert record_state_key(identity, mine) != record_state_key(identity, theirs)
    assert record_state_key(identity, mine) == state_key(identity, mine.input_ids[: mine.state_start +
                                                                                 mine.state_tokens],
                                                         media=bytes.fromhex(mine.media.digest))
    got = model.predict([first, other], batch_size=1)
    stats = model.state_cache.stats()
    assert (stats.misses, stats.hits, stats.entries) == (2, 0, 2)
    want = cold.predict([first, other], batch_size=1)
    assert max_dp(got, want) <= FLOAT32_BOUND
    # each hit has its own image's numbers: the two images' answers differ well beyond the bound, their states more
    assert max_dp([got[0]], [got[1]]) > 4 * FLOAT32_BOUND
    states = [model.state_cache.get(record_state_key(identity, r)) for r in (mine, theirs)]
    assert float((states[0].hidden - states[1].hidden).abs().max()) > 1e-2
    hits = model.state_cache.stats().hits  # (the two gets above count too)
    model.predict([first, other], batch_size=2)  # both cached now
    assert model.state_cache.stats().hits == hits + 2 and model.state_cache.stats().misses == 2


def test_the_continuation_needs_the_rope_offset(tiny_vision: Path) -> None:
    """Without the media's offset the schema's positions would be wrong: the numbers move (the offset is used)."""
    model = clef_local.load(tiny_vision, dtype="float32", state_cache="256MiB")
    model.decide(REQUESTS[0])
    (key,) = model.state_cache.sizes()
    state = model.state_cache.get(key)
    assert isinstance(state, TorchState) and state.position_offset < 0
    right = continued(model, [REQUESTS[1]], state)
    wrong = continued(model, [REQUESTS[1]], replace(state, position_offset=0))
    assert float((right - wrong).abs().max()) > 1e-3


def test_text_with_a_vision_token_keys_and_runs_as_text(tiny_vision: Path, cold: clef_local.ClefModel) -> None:
    """A text-only record spelling <|image_pad|> beside an image request: its state is the text model's, keyed on
    its ids alone (no media digest), with its cold numbers."""
    model = clef_local.load(tiny_vision, dtype="float32", state_cache="256MiB")
    model.pad_waste = float("inf")
    odd = {"model": "m", "state": "the token <|image_pad|> as text", "questions": {"q": {"type": "noul"}}}
    odd2 = {**odd, "questions": {"r": {"type": "score", "criteria": ["low", "high"]}}}
    batch = [REQUESTS[3], odd, REQUESTS[4], odd2]
    got = model.predict(batch, batch_size=4)
    assert model.state_cache.stats().misses == 2 and model.state_cache.stats().hits == 2
    encoded = model.encode(odd)
    assert encoded.media is None and model.tokenizer.token_to_id("<|image_pad|>") in encoded.input_ids
    key = state_key(model.backend.state_identity, encoded.input_ids[: encoded.state_start + encoded.state_tokens])
    entry = model.state_cache.get(key)
    assert isinstance(entry, TorchState) and entry.position_offset == 0
    assert max_dp(got, cold.predict(batch, batch_size=1)) <= FLOAT32_BOUND


def test_host_embeddings_state_pass_equals_cold(tiny_vision: Path, cold: clef_local.ClefModel) -> None:
    """The state pass and its continuation with the embeddings gathered on the host (what a CUDA device does)."""
    model = clef_local.load(tiny_vision, dtype="float32", state_cache="256MiB")
    model.backend.backbone.host_embeddings = True
    got = model.predict(REQUESTS[:5], batch_size=1)  # two states: 2 and 3 schemas
    assert (model.state_cache.stats().misses, model.state_cache.stats().hits) == (2, 3)
    assert max_dp(got, cold.predict(REQUESTS[:5], batch_size=1)) <= FLOAT32_BOUND


def test_video_states_hit_like_a_cold_pass(tiny_vision: Path, cold: clef_local.ClefModel) -> None:
    from clef_local.runtime.processor import video_unavailable

    reason = video_unavailable()
    if reason:
        pytest.skip(reason)
    model = clef_local.load(tiny_vision, dtype="float32", state_cache="256MiB")
    requests = []
    for i, (w, h, n) in enumerate([(64, 48, 4), (96, 160, 6), (48, 48, 2)]):
        frames = [data_uri(image(w, h, seed=10 * i + s)) for s in range(n)]
        base = {"model": "m", "state": {"clip": i}, "videos": [frames],
                "images": BASES[i]["images"][:1] if i % 2 else []}
        requests += [{**base, "questions": BASES[i]["questions"]}, {**base, "questions": BASES[i + 1]["questions"]}]
    got = model.predict(requests, batch_size=1)
    assert model.state_cache.stats().misses == 3 and model.state_cache.stats().hits == 3
    assert max_dp(got, cold.predict(requests, batch_size=1)) <= FLOAT32_BOUND
    mixed = model.predict([*requests, REQUESTS[0], TEXT_ONLY[0]], batch_size=8)
    assert max_dp(mixed[:6], got) <= FLOAT32_BOUND
