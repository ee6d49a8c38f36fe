"""Chunked prefill (docs/hardware.md#chunked-prefill) gives the one pass's probabilities (float32, ≤ 1e-5): the tiny
Qwen3.5 release (a 262,144-token backbone, so the default context is 65,536) at 16K and 32K tokens (64K:
tests/test_context_memory.py, end to end through ``clef-local decide``), padded batches, the tiny Llama, a record
with an image (its first chunk holds the media), and the state cache (a chunked state pass, then chunked
continuations over it). Each test counts the backbone's forward calls, so that a pass that silently ran in one piece
would fail."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from media_gen import data_uri, image
from request_gen import LONG_QUESTIONS, long_state, max_dp

import clef_local
from clef_local.runtime.encoding import EncodedRecord

FLOAT32_BOUND = 1e-5
QUESTIONS = LONG_QUESTIONS


def record_of(model: clef_local.ClefModel, tokens: int, seed: int = 0, **extra: Any) -> EncodedRecord:
    """A request of exactly ``tokens`` tokens: a long state cut to fit a context of that many."""
    context, model.encoder.max_length = model.encoder.max_length, tokens
    try:
        record = model.encode({"model": "m", "state": long_state(6 * tokens, seed), "questions": QUESTIONS,
                               **extra}, truncate_state=True)
    finally:
        model.encoder.max_length = context
    assert len(record.input_ids) == tokens and record.truncated_tokens > 0
    return record


def probabilities(model: clef_local.ClefModel, records: list[EncodedRecord], batch_size: int = 1
                  ) -> list[clef_local.Prediction]:
    out: list[Any] = [None] * len(records)
    for indices, predictions in model.run(records, batch_size=batch_size):
        for i, p in zip(indices, predictions, strict=True):
            out[i] = p
    return out


def count_forwards(model: clef_local.ClefModel, media: list[int] | None = None) -> list[int]:
    """Record the length of every forward of ``model``'s backbone (a spy on ``TorchBackbone.forward``); ``media``
    also gets the end position of each forward that runs the multimodal model."""
    lengths: list[int] = []
    backbone = model.backend.backbone
    forward = backbone.forward

    def spy(input_ids: Any, attention_mask: Any, **kwargs: Any) -> Any:
        lengths.append(int(input_ids.shape[1]))
        if media is not None and kwargs.get("media") is not None:
            media.append(int(attention_mask.shape[1]))
        return forward(input_ids, attention_mask, **kwargs)

    backbone.forward = spy
    return lengths


def discriminates(predictions: list[clef_local.Prediction]) -> bool:
    """The head's answers are not uniform: a comparison of them is not one of constants."""
    return max(float(p.max() - p.min()) for a in predictions for p in a.probabilities) > 0.02


@pytest.fixture(scope="module")
def one_pass(tiny_qwen: Path) -> clef_local.ClefModel:
    return clef_local.load(tiny_qwen, dtype="float32", state_cache=0, prefill_chunk=0)


@pytest.fixture(scope="module")
def chunked(tiny_qwen: Path) -> clef_local.ClefModel:
    return clef_local.load(tiny_qwen, dtype="float32", state_cache=0, prefill_chunk=4096)


def test_the_default_context_is_the_published_window(one_pass: clef_local.ClefModel, tiny_llama: Path) -> None:
    assert one_pass.release.max_position_embeddings == 262_144 and one_pass.max_length == 65_536
    assert clef_local.load(tiny_llama, dtype="float32").max_length == 8192  # its backbone's context


def test_chunked_equals_one_pass_at_16k(one_pass: clef_local.ClefModel, chunked: clef_local.ClefModel) -> None:
    record = record_of(one_pass, 16_384)
    want = probabilities(one_pass, [record])
    forwards = count_forwards(chunked)
    got = probabilities(chunked, [record])
    assert forwards == [4096] * 4
    worst = max_dp(got, want)
    print(f"16K: max |Δp| chunked vs one pass {worst:.2e}")
    assert worst <= FLOAT32_BOUND and discriminates(want)


@pytest.mark.slow
def test_chunked_equals_one_pass_at_32k(one_pass: clef_local.ClefModel, chunked: clef_local.ClefModel) -> None:
    # 64K: tests/test_context_memory.py, through `clef-local decide` in the planner's chunks
    record = record_of(one_pass, 32_768, seed=1)
    want = probabilities(one_pass, [record])
    forwards = count_forwards(chunked)
    got = probabilities(chunked, [record])
    assert forwards == [4096] * 8
    worst = max_dp(got, want)
    print(f"32K: max |Δp| chunked vs one pass {worst:.2e}")
    assert worst <= FLOAT32_BOUND and discriminates(want)


def test_a_padded_batch_in_chunks_equals_each_record_alone(one_pass: clef_local.ClefModel, tiny_qwen: Path) -> None:
    records = [record_of(one_pass, n, seed=n) for n in (1500, 900, 1300)]
    want = probabilities(one_pass, records)
    model = clef_local.load(tiny_qwen, dtype="float32", state_cache=0, prefill_chunk=512)
    model.pad_waste = float("inf")  # one right-padded batch, as on an accelerator
    forwards = count_forwards(model)
    got = probabilities(model, records, batch_size=3)
    assert forwards == [512, 512, 476]  # one batch of three rows, padded to 1,500 tokens
    worst = max_dp(got, want)
    print(f"padded batch of 3: max |Δp| chunked vs one by one {worst:.2e}")
    assert worst <= FLOAT32_BOUND and discriminates(want)


def test_llama_chunked_equals_one_pass(tiny_llama: Path) -> None:
    whole = clef_local.load(tiny_llama, dtype="float32", state_cache=0, prefill_chunk=0)
    model = clef_local.load(tiny_llama, dtype="float32", state_cache=0, prefill_chunk=1024)
    model.pad_waste = float("inf")
    records = [record_of(whole, 8192), record_of(whole, 5000, seed=1)]  # its whole context, and a padded row
    want = probabilities(whole, records)
    forwards = count_forwards(model)
    got = probabilities(model, records, batch_size=2)
    assert forwards == [1024] * 8
    worst = max_dp(got, want)
    print(f"llama 8K + 5K in one padded batch: max |Δp| chunked vs one pass {worst:.2e}")
    assert worst <= FLOAT32_BOUND and discriminates(want)


def test_a_record_with_an_image_keeps_its_media_in_the_first_chunk(tiny_vision: Path) -> None:
    whole = clef_local.load(tiny_vision, dtype="float32", state_cache=0, prefill_chunk=0)
    model = clef_local.load(tiny_vision, dtype="float32", state_cache=0, prefill_chunk=128)
    images = [data_uri(image(640, 480, seed=3))]  # ~300 visual tokens: more than one chunk
    record = record_of(whole, 900, images=images)
    text_only = record_of(whole, 900, seed=5)
    assert record.media is not None
    media_end = record.media.token_offset + len(record.media.token_ids)
    assert media_end > 128
    want = probabilities(whole, [record, text_only])
    ends: list[int] = []
    forwards = count_forwards(model, ends)
    model.pad_waste = float("inf")
    got = probabilities(model, [record, text_only], batch_size=2)
    first = -(-media_end // 128) * 128
    assert ends == [first]  # the multimodal model runs the first chunk, which holds every visual token
    # the text-only row's chunks (7 of 128, one of 4), then the image row's: its first, then the rest
    assert forwards == [128] * 7 + [4] + [first] + [min(a + 128, 900) - a for a in range(first, 900, 128)]
    worst = max_dp(got, want)
    print(f"an image + a text record in chunks of 128: max |Δp| vs one pass {worst:.2e}")
    assert worst <= FLOAT32_BOUND and discriminates(want)


def test_a_cached_state_and_chunked_continuations_equal_a_cold_pass(tiny_qwen: Path,
                                                                     one_pass: clef_local.ClefModel) -> None:
    many = {f"o{i:03d}": f"option number {i} of a long list" for i in range(20)}  # a schema longer than a chunk
    schemas = [QUESTIONS, {"pick": {"type": "choice", "instructions": "Which?", "criteria": many}},
               {"urgent": {"type": "noul"}, "pick": {"type": "choice", "criteria": many}}]
    state = long_state(4000, seed=7)
    requests = [{"model": "m", "state": state, "questions": q} for q in schemas]
    want = one_pass.predict(requests, batch_size=1)
    model = clef_local.load(tiny_qwen, dtype="float32", state_cache="64MiB", prefill_chunk=256)
    forwards = count_forwards(model)
    got = model.predict(requests, batch_size=1)
    stats = model.state_cache.stats()
    assert (stats.misses, stats.hits) == (1, 2)
    state_tokens = got[0].encoded.state_start + got[0].encoded.state_tokens
    tails = [len(p.encoded.input_ids) - state_tokens for p in got]
    assert max(tails) > 512 and state_tokens > 512
    # every pass is cut at multiples of 256 counted from the first position: the state pass, then each schema
    assert len(forwards) == len(range(0, state_tokens, 256)) + sum(
        len({(state_tokens + k) // 256 for k in range(tail)}) for tail in tails)
    assert max(forwards) == 256
    worst = max_dp(got, want)
    print(f"state cache, a chunked state pass + 3 chunked continuations: max |Δp| vs cold {worst:.2e}")
    assert worst <= FLOAT32_BOUND and discriminates(want)
    assert all(np.isfinite(p).all() for a in got for p in a.probabilities)
