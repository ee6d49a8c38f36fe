"""Contexts to 64K (docs/format.md §2, docs/hardware.md#chunked-prefill): ``max_length`` up to the backbone's
context and refused above it, naming both; memory counted at the requested length; a request whose pass does not fit
the memory left is a 413 naming the numbers (before it is queued); the planner's chunk lengths; and a 64K request
answered end to end by ``clef-local decide`` on the tiny Qwen3.5 release, in the planner's chunks."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from request_gen import LONG_QUESTIONS as QUESTIONS
from request_gen import long_state

import clef_local
from clef_local.cli import main
from clef_local.errors import ApiUsageError, InsufficientMemoryError, RequestMemoryError
from clef_local.planning.estimate import (
    PREFILL_MAX_CHUNK,
    PREFILL_STEP,
    activations,
    chunked_activations,
    fit_chunk,
    plan,
)
from clef_local.planning.hardware import detect_cpu
from clef_local.planning.planner import footprint_from_release
from clef_local.units import MiB


def cap_for_room(release: Path, room: int) -> str:
    """The ``max_memory`` (bytes, as text) that leaves ``room`` bytes for a prefill's activations beside the tiny
    release's float32 weights and the runtime (no state cache): the inverse of ``Plan.activation_room``."""
    footprint = footprint_from_release(release)
    p = plan(footprint.censuses[footprint.stored], footprint.dims, detect_cpu(), context=256, dtype="float32",
             media=True)
    cap = int((room + p.device_weights) * 1.05) + p.overhead + 2
    capped = plan(footprint.censuses[footprint.stored], footprint.dims, replace(detect_cpu(), free_bytes=cap),
                  context=256, dtype="float32", media=True)
    assert room <= capped.activation_room <= room + 2
    return str(cap)


def dims_of(release: Path) -> Any:
    return footprint_from_release(release).dims


def test_max_length_up_to_the_backbone_and_no_further(tiny_llama: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert clef_local.load(tiny_llama, dtype="float32", max_length=8192).max_length == 8192
    with pytest.raises(ApiUsageError, match=r"max_length 9,000 is above the backbone's context of 8,192 tokens"):
        clef_local.load(tiny_llama, dtype="float32", max_length=9000)
    with pytest.raises(ApiUsageError, match="positive number of tokens"):
        clef_local.load(tiny_llama, dtype="float32", max_length=0)
    assert main(["decide", "--model", str(tiny_llama), "--max-length", "9000", "--example", "triage"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "9,000" in err and "8,192" in err


def test_the_planner_chunks_only_what_does_not_fit(tiny_qwen: Path) -> None:
    dims = dims_of(tiny_qwen)
    one = activations(dims, 65_536, 1, "float32").total
    assert fit_chunk(dims, 65_536, 1, "float32", one) is None  # the one pass fits: no chunking
    room = one // 2
    chunk = fit_chunk(dims, 65_536, 1, "float32", room)
    assert chunk is not None and chunk % PREFILL_STEP == 0 and PREFILL_STEP <= chunk <= PREFILL_MAX_CHUNK
    assert chunked_activations(dims, 65_536, 1, "float32", chunk).total <= room
    assert chunked_activations(dims, 65_536, 1, "float32", chunk + PREFILL_STEP).total > room
    assert fit_chunk(dims, 65_536, 1, "float32", 1 * MiB) == 0  # not even the shortest chunk fits
    # a chunked pass keeps every attention layer's keys and values and the output states over the whole context
    kept = chunked_activations(dims, 65_536, 1, "float32", 4096).kept
    assert kept == 65_536 * 4 * (dims.hidden + 1 * 2 * dims.kv_heads * dims.head_dim)


def test_a_request_that_does_not_fit_the_memory_left_is_413(tiny_qwen: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    dims = dims_of(tiny_qwen)
    small = chunked_activations(dims, 16_384, 1, "float32", PREFILL_STEP).total
    large = chunked_activations(dims, 65_536, 1, "float32", PREFILL_STEP).total
    assert small < large
    cap = cap_for_room(tiny_qwen, (small + large) // 2)
    refusal = r"at 65,536 tokens.*max_length=\d+ \(a context of [\d,]+ tokens fits\)"
    with pytest.raises(InsufficientMemoryError, match=refusal):
        clef_local.load(tiny_qwen, dtype="float32", state_cache=0, max_memory=cap, max_length=65_536)
    with caplog.at_level(logging.WARNING, logger="clef_local.backends.loader"):
        model = clef_local.load(tiny_qwen, dtype="float32", state_cache=0, max_memory=cap)
    assert model.max_length == 65_536 and model.backend.load_decision.context == 16_384
    assert "planned at 16,384 tokens instead" in caplog.text
    request = {"model": "m", "state": long_state(6 * 65_536), "questions": QUESTIONS}
    with pytest.raises(RequestMemoryError) as refused:
        model.encode(request, truncate_state=True)
    error = refused.value
    assert error.status_code == 413 and error.error_type == "max_tokens_exceeded"
    assert error.input_tokens == 65_536 and 16_384 <= error.max_tokens < 65_536
    assert error.need_bytes > error.budget_bytes == model.backend.prefill.room
    assert f"the longest request that fits here is {error.max_tokens:,} tokens" in str(error)
    assert "GiB" in str(error) or "MiB" in str(error)
    # the longest request it names does fit, and is answered
    fits = model.backend.prefill
    assert fits.fits(error.max_tokens) and not fits.fits(error.max_tokens + 1)
    short = {"model": "m", "state": long_state(3000), "questions": QUESTIONS}
    answer = model.decide(short)
    assert answer["usage"]["input_tokens"] < error.max_tokens


def test_a_batch_is_cut_to_the_rows_whose_pass_fits(tiny_qwen: Path) -> None:
    room = chunked_activations(dims_of(tiny_qwen), 1024, 3, "float32", PREFILL_STEP).total  # 3 rows, not 4
    model = clef_local.load(tiny_qwen, dtype="float32", state_cache=0, max_memory=cap_for_room(tiny_qwen, room),
                            max_length=1024)
    prefill = model.backend.prefill
    assert prefill.fits(1024, 3) and not prefill.fits(1024, 4) and prefill.rows(1024, 8) == 3
    records = [model.encode({"model": "m", "state": long_state(4000, seed=i), "questions": QUESTIONS},
                            truncate_state=True) for i in range(7)]
    assert {len(r.input_ids) for r in records} == {1024}
    sizes = [len(indices) for indices, _ in model.run(records, batch_size=8)]
    assert sizes == [3, 3, 1]


@pytest.mark.slow
def test_decide_answers_a_64k_request_in_the_planners_chunks_as_one_pass_does(
        tiny_qwen: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from clef_local.backends.torch_backend import TorchBackbone

    dims = dims_of(tiny_qwen)
    one = activations(dims, 65_536, 1, "float32").total
    cap = cap_for_room(tiny_qwen, one * 3 // 4)  # the one pass does not fit, chunks do
    chunk = fit_chunk(dims, 65_536, 1, "float32", one * 3 // 4)
    assert chunk and chunk % PREFILL_STEP == 0
    request = {"model": "m", "state": long_state(6 * 65_536), "questions": QUESTIONS}
    whole = clef_local.load(tiny_qwen, dtype="float32", state_cache=0, prefill_chunk=0)
    want = whole.decide(request, truncate_state=True)
    del whole
    lengths: list[int] = []
    forward = TorchBackbone.forward

    def spy(self: Any, input_ids: Any, attention_mask: Any, **kwargs: Any) -> Any:
        lengths.append(int(input_ids.shape[1]))
        return forward(self, input_ids, attention_mask, **kwargs)

    monkeypatch.setattr(TorchBackbone, "forward", spy)
    file = tmp_path / "long.json"
    file.write_text(json.dumps(request))
    code = main(["decide", "--model", str(tiny_qwen), "--dtype", "float32", "--max-length", "65536",
                 "--max-memory", cap, "--truncate-state", "--full-precision", "--request", str(file)])
    assert code == 0
    got = json.loads(capsys.readouterr().out)
    assert got["usage"]["input_tokens"] == want["usage"]["input_tokens"] == 65_536
    # the planner's chunks, cut at its multiples (and where a state cache beside them cuts the pass at the state)
    assert sum(lengths) == 65_536 and max(lengths) == chunk and len(lengths) >= 65_536 // chunk
    got_p, want_p = answer_probabilities(got), answer_probabilities(want)
    assert got_p.keys() == want_p.keys() and len(got_p) == 2 + 3 + 3  # noul's p(true), the choice, the score
    worst = max(abs(got_p[k] - want_p[k]) for k in got_p)
    print(f"64K through decide in {chunk:,}-token chunks: max |Δp| vs one pass {worst:.2e}")
    assert worst <= 1e-5
    assert max(want_p.values()) - min(want_p.values()) > 0.02  # the head discriminates: not a comparison of constants


def answer_probabilities(response: dict[str, Any]) -> dict[tuple[str, str], float]:
    """Every probability of a response: noul's ``p(true)`` and each option's of the others."""
    out: dict[tuple[str, str], float] = {}
    for question, answer in response["answers"].items():
        if answer["type"] == "noul":
            out[(question, "true")], out[(question, "false")] = answer["noul"], 1 - answer["noul"]
        else:
            out.update({(question, option): p for option, p in answer["probabilities"].items()})
    return out
