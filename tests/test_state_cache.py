"""The state cache on real (tiny) models: a hit equals a cold pass, for both backbone kinds, batched, truncated,
quantized and cut; entries are exact in size, never written, bounded, shared by threads, dropped on out-of-memory."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from request_gen import STATES, continued, max_dp, shared_state_requests

import clef_local
from clef_local.backends.torch_cache import TorchState
from clef_local.planning.estimate import ModelDims, state_entry_bytes

# 12 states (the varied ones + two long ones) × 5 schemas: 60 requests, 12 state passes, 48 hits
LONG_STATES: list[Any] = [*STATES, "A much longer ticket thread, message after message. " * 40,
                          {"trace": [f"step {i}: tool call returned ok" for i in range(60)]}]
REQUESTS = shared_state_requests(LONG_STATES, 5, seed=1)
FLOAT32_BOUND = 1e-5


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen"])
def release(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def cold(release: Path) -> clef_local.ClefModel:
    return clef_local.load(release, dtype="float32", state_cache=0)


@pytest.fixture(scope="module")
def cold_answers(cold: clef_local.ClefModel) -> list[clef_local.Prediction]:
    return cold.predict(REQUESTS, batch_size=1)


def test_hits_equal_a_cold_pass_over_60_requests(release: Path, cold: clef_local.ClefModel,
                                                  cold_answers: list[clef_local.Prediction]) -> None:
    assert not cold.state_cache.enabled
    model = clef_local.load(release, dtype="float32", state_cache="64MiB")
    one_by_one = model.predict(REQUESTS, batch_size=1)
    stats = model.state_cache.stats()
    assert (stats.misses, stats.hits, stats.stores, stats.evictions) == (12, 48, 12, 0)
    assert max_dp(one_by_one, cold_answers) <= FLOAT32_BOUND
    # again, batched: every state is cached now, and batch mates that share a state run as one continuation
    batched = model.predict(REQUESTS, batch_size=8)
    assert model.state_cache.stats().hits == 48 + 60 and model.state_cache.stats().misses == 12
    assert max_dp(batched, cold_answers) <= FLOAT32_BOUND
    # the head discriminates (the comparison is not of constants)
    assert max(float(p.max() - p.min()) for a in cold_answers for p in a.probabilities) > 0.05


def test_a_batch_of_new_states_runs_each_state_once(release: Path,
                                                     cold_answers: list[clef_local.Prediction]) -> None:
    model = clef_local.load(release, dtype="float32", state_cache="64MiB")
    model.pad_waste = 100.0  # one padded batch of mixed states and lengths, as on an accelerator
    passes: list[int] = []
    original = model.backend.backbone.forward

    def spy(input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        passes.append(input_ids.shape[0])
        return original(input_ids, attention_mask, **kwargs)

    model.backend.backbone.forward = spy  # type: ignore[method-assign]
    answers = model.predict(REQUESTS[:20], batch_size=20)  # 4 states × 5 schemas
    # per state: one state pass (1 row) and one continuation of its 5 schemas (right-padded)
    assert passes == [1, 5] * 4
    assert model.state_cache.stats().misses == 4 and model.state_cache.stats().hits == 16
    assert max_dp(answers, cold_answers[:20]) <= FLOAT32_BOUND


def test_entries_are_exact_in_size_and_never_written(release: Path) -> None:
    model = clef_local.load(release, dtype="float32", state_cache="64MiB")
    model.decide(REQUESTS[0])
    (key,) = model.state_cache.sizes()
    entry = model.state_cache.get(key)
    assert isinstance(entry, TorchState)
    tensors = [entry.hidden, *(t for layer in entry.layers for t in
                               ((layer.keys, layer.values) if hasattr(layer, "keys") else (*layer.conv,
                                                                                           *layer.recurrent)))]
    assert entry.nbytes == sum(t.untyped_storage().nbytes() for t in tensors) == model.state_cache.stats().bytes
    dims = ModelDims.from_config(model.release.config)
    assert entry.nbytes == state_entry_bytes(dims, entry.tokens, "float32")  # the planner's formula is exact
    before = [t.clone() for t in tensors]
    model.decide_batch(REQUESTS[1:5], batch_size=4)  # four continuations from this entry
    assert all(torch.equal(a, b) for a, b in zip(before, tensors, strict=True))


def test_truncated_states_key_on_the_ids_they_keep(release: Path) -> None:
    long_state = "A ticket that goes on and on about a missing refund. " * 30
    cold = clef_local.load(release, dtype="float32", state_cache=0, max_length=300)
    model = clef_local.load(release, dtype="float32", state_cache="64MiB", max_length=300)

    def ask(qid: str, **extra: Any) -> dict[str, Any]:
        return {"model": "m", "state": long_state,
                "questions": {qid: {"type": "noul", "instructions": "Is it urgent?"}, **extra}}

    def dropped(request: dict[str, Any]) -> int:
        return model.encode(request, truncate_state=True).truncated_tokens

    # two schemas of one token count truncate the state alike (the first other id that tokenizes like "a");
    # a longer schema keeps less of it
    twin = next(qid for qid in "bcdefghijklmnopqrstuvwxyz" if dropped(ask(qid)) == dropped(ask("a")))
    requests = [ask("a"), ask(twin), ask("a", b={"type": "score", "criteria": ["low", "mid", "high"]})]
    encoded = [model.encode(r, truncate_state=True) for r in requests]
    assert encoded[0].input_ids != encoded[1].input_ids
    assert encoded[0].truncated_tokens == encoded[1].truncated_tokens > 0
    assert encoded[2].truncated_tokens > encoded[0].truncated_tokens
    got = model.predict(requests, truncate_state=True, batch_size=1)
    stats = model.state_cache.stats()
    assert (stats.misses, stats.hits) == (2, 1)  # the second schema hits; the longer one keys on fewer ids
    assert max_dp(got, cold.predict(requests, truncate_state=True, batch_size=1)) <= FLOAT32_BOUND


def test_eviction_by_bytes_on_a_real_model(release: Path) -> None:
    probe = clef_local.load(release, dtype="float32", state_cache="64MiB")
    requests = [REQUESTS[i * 5] for i in (0, 1, 3)]  # three different states
    probe.predict(requests, batch_size=1)
    sizes = list(probe.state_cache.sizes().values())
    budget = sizes[1] + sizes[2]  # room for the last two only
    model = clef_local.load(release, dtype="float32", state_cache=budget)
    model.predict(requests, batch_size=1)
    assert list(model.state_cache.sizes().values()) == sizes[1:]
    assert model.state_cache.stats().evictions == 1 and model.state_cache.stats().bytes <= budget
    model.decide(REQUESTS[1])  # the first state again: it was evicted, so it runs again
    assert model.state_cache.stats().misses == 4 and model.state_cache.stats().bytes <= budget
    tiny = clef_local.load(release, dtype="float32", state_cache=min(sizes) - 1)
    tiny.predict(requests, batch_size=1)  # every entry is larger than the budget: nothing stored, still answered
    assert tiny.state_cache.stats().rejected == 3 and len(tiny.state_cache) == 0


def test_threads_hammer_one_model(release: Path, cold_answers: list[clef_local.Prediction]) -> None:
    model = clef_local.load(release, dtype="float32", state_cache="64MiB")
    picks = list(range(0, 30))  # 6 states × 5 schemas
    results: dict[tuple[int, int], list[np.ndarray]] = {}
    errors: list[BaseException] = []

    def worker(thread: int) -> None:
        try:
            for round_ in range(2):
                for i in picks[thread::4]:
                    results[(i, round_)] = model.predict([REQUESTS[i]])[0].probabilities
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = model.state_cache.stats()
    assert stats.hits + stats.misses == 60 and 6 <= stats.misses < 30 and stats.entries == 6
    worst = max(float(np.abs(x - y).max()) for (i, _), probs in results.items()
                for x, y in zip(probs, cold_answers[i].probabilities, strict=True))
    assert worst <= FLOAT32_BOUND


def test_out_of_memory_clears_the_cache_and_runs_again(release: Path, caplog: pytest.LogCaptureFixture,
                                                       cold_answers: list[clef_local.Prediction]) -> None:
    model = clef_local.load(release, dtype="float32", state_cache="64MiB")
    model.predict(REQUESTS[:10:5], batch_size=1)  # two states cached
    assert len(model.state_cache) == 2
    backbone = model.backend.backbone
    original = backbone.forward
    failures = [1]

    def flaky(input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if failures[0]:
            failures[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return original(input_ids, attention_mask, **kwargs)

    backbone.forward = flaky  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="clef_local.backends.torch_backend"):
        answer = model.predict([REQUESTS[11]])[0]
    assert "out of memory" in caplog.text and "cleared the state cache" in caplog.text
    stats = model.state_cache.stats()
    assert stats.memory_clears == 1 and len(model.state_cache) == 0
    assert max_dp([answer], [cold_answers[11]]) <= FLOAT32_BOUND  # the retry ran the batch cold

    failures[0] = 0
    model.decide(REQUESTS[0])  # cached again
    failures[0] = 2  # fails again on the retry: the error reaches the caller
    with pytest.raises(torch.OutOfMemoryError):
        model.decide(REQUESTS[21])
    assert model.state_cache.stats().memory_clears == 2 and len(model.state_cache) == 0

    failures[0] = 0
    model.decide(REQUESTS[0])
    assert len(model.state_cache) == 1

    def broken(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("shape mismatch in layer 3")

    backbone.forward = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="shape mismatch"):  # not a memory error: nothing is cleared
        model.decide(REQUESTS[26])
    assert len(model.state_cache) == 1 and model.state_cache.stats().memory_clears == 2


def test_each_load_has_its_own_cache(release: Path) -> None:
    first = clef_local.load(release, dtype="float32", state_cache="64MiB")
    first.decide(REQUESTS[0])
    again = clef_local.load(release, dtype="float32", state_cache="64MiB")
    assert len(first.state_cache) == 1 and len(again.state_cache) == 0  # reloaded: empty
    other_dtype = clef_local.load(release, dtype="bfloat16", state_cache="64MiB")
    assert other_dtype.backend.state_identity != first.backend.state_identity
    first.state_cache.clear()
    assert first.state_cache.stats().bytes == 0


def test_bfloat16_hits_equal_a_cold_bfloat16_pass(release: Path) -> None:
    cold = clef_local.load(release, dtype="bfloat16", state_cache=0)
    model = clef_local.load(release, dtype="bfloat16", state_cache="64MiB")
    requests = REQUESTS[:10]
    model.predict(requests, batch_size=1)
    assert model.state_cache.stats().hits == 8
    dims = ModelDims.from_config(model.release.config)
    (key, size), *_ = model.state_cache.sizes().items()
    entry = model.state_cache.get(key)
    assert isinstance(entry, TorchState) and size == state_entry_bytes(dims, entry.tokens, "bfloat16")
    # bf16 rounds each layer's output: a split pass is not bit-equal; the bound is bf16's batch-vs-single tolerance
    assert max_dp(model.predict(requests, batch_size=1), cold.predict(requests, batch_size=1)) <= 2e-2


def test_a_quantized_variant_caches_exactly(tiny_llama: Path, tiny_qwen: Path, tmp_path: Path) -> None:
    from clef_local.export.quantize import quantize_release

    for name, source in (("llama", tiny_llama), ("qwen", tiny_qwen)):
        variant = tmp_path / f"{name}-int8"
        quantize_release(source, variant, "int8", validate=False, log_summary=False)
        cold = clef_local.load(variant, dtype="float32", state_cache=0)
        model = clef_local.load(variant, dtype="float32", state_cache="64MiB")
        assert model.backend.backbone.scheme == "int8"
        requests = REQUESTS[25:45]
        model.predict(requests, batch_size=1)
        assert model.state_cache.stats().hits == 16
        reference = clef_local.load(source, dtype="float32", state_cache="64MiB")
        assert reference.backend.state_identity != model.backend.state_identity  # never shares a key
        assert max_dp(model.predict(requests, batch_size=4), cold.predict(requests, batch_size=1)) <= FLOAT32_BOUND


def test_continuation_pads_rows_to_the_longest_tail(tiny_qwen: Path) -> None:
    model = clef_local.load(tiny_qwen, dtype="float32", state_cache="64MiB")
    model.decide(REQUESTS[0])
    (key,) = model.state_cache.sizes()
    state = model.state_cache.get(key)
    assert isinstance(state, TorchState)
    tails = [model.encode(r).input_ids[state.tokens:] for r in REQUESTS[0:3]]
    assert len({len(t) for t in tails}) > 1
    together = continued(model, REQUESTS[0:3], state)
    for row, tail in enumerate(tails):
        alone = continued(model, [REQUESTS[row]], state)
        end = state.tokens + len(tail)
        assert float((together[row, state.tokens:end] - alone[0, state.tokens:end]).abs().max()) < 1e-4
