"""Two cards and memory caps: --device cuda:0,cuda:1 (a pipeline split of the decoder layers) and --max-memory
(clef_local.planning.caps, clef_local.planning.split, clef_local.backends.placement, the loader)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from request_gen import varied_requests

import clef_local
from clef_local.backends.placement import check_stages, move
from clef_local.errors import ApiUsageError, InsufficientMemoryError
from clef_local.planning import planner
from clef_local.planning.caps import cap_for, parse_max_memory, parse_size, resolve_devices, with_cap
from clef_local.planning.choice import plan_load, plan_split
from clef_local.planning.hardware import Hardware, named_device, resolve_device
from clef_local.planning.load_options import LoadOptions
from clef_local.planning.split import cut, render_split, split_plan
from clef_local.units import GiB

TORCH = {"torch": None, "mlx": "no", "onnx": "no"}
CARD_24 = named_device("24GiB")


@pytest.fixture(scope="module")
def clef():
    return planner.footprint_from_config(planner.packaged_config("clef"), formats=("int8", "int4"))


def test_sizes_and_caps_parse() -> None:
    assert parse_size("24GiB") == 24 * GiB == parse_size("24 gib") == parse_size("24576MiB")
    assert parse_size("25.7GB") == 25_700_000_000 and parse_size("1024") == 1024
    assert parse_max_memory("cuda:0=24GiB, cuda:1=20GiB") == {"cuda:0": 24 * GiB, "cuda:1": 20 * GiB}
    assert parse_max_memory({"cuda": "24GiB", "cpu": 8 * GiB}) == {"cuda:0": 24 * GiB, "cpu": 8 * GiB}
    caps = parse_max_memory("24GiB")
    assert cap_for(caps, "cuda:3") == 24 * GiB and cap_for({}, "cpu") is None
    for bad, message in (("cuda:0=24XB", "cannot read the memory size '24XB'"), ("gpu0=24GiB", "unknown device 'gpu0'"),
                         ("cuda:0=1GiB,cuda:0=2GiB", "gives cuda:0 twice"), ("cpu=0", "must be positive")):
        with pytest.raises(ValueError, match=message):
            parse_max_memory(bad)


def test_a_cap_makes_a_large_card_a_small_one() -> None:
    h200 = named_device("h200")
    capped = with_cap(h200, 24 * GiB)
    assert (capped.free_bytes, capped.total_bytes, capped.cap_bytes) == (24 * GiB, 24 * GiB, 24 * GiB)
    assert "capped at 24.0 GiB" in capped.name and with_cap(h200, None) is h200
    assert with_cap(CARD_24, 200 * GiB).free_bytes == CARD_24.free_bytes  # a cap never adds memory


def test_device_lists() -> None:
    cards = resolve_devices("24GiB,48GiB", {}, resolve_device)
    assert [(h.device, h.free_bytes) for h in cards] == [("cuda:0", 24 * GiB), ("cuda:1", 48 * GiB)]
    capped = resolve_devices("h200,h200", parse_max_memory("cuda:1=20GiB"), resolve_device)
    assert [h.free_bytes for h in capped] == [named_device("h200").free_bytes, 20 * GiB]
    box = Hardware(kind="cpu", name="box", device="cpu", total_bytes=16 * GiB, free_bytes=16 * GiB)
    shared = resolve_devices("cpu,cpu", {"cpu": 8 * GiB}, lambda name: box)  # one device listed twice: halves
    assert [h.free_bytes for h in shared] == [4 * GiB, 4 * GiB]
    with pytest.raises(ValueError, match="a split needs devices of one kind"):
        resolve_devices("cpu,24GiB", {}, lambda name: box if name == "cpu" else CARD_24)
    with pytest.raises(ValueError, match="empty device name"):
        resolve_devices("cuda:0,", {}, resolve_device)


def test_cut_follows_the_budgets() -> None:
    assert cut([1] * 8, [1, 1]) == [(0, 4), (4, 8)]
    assert cut([1] * 9, [1, 2]) == [(0, 3), (3, 9)]
    assert cut([10, 1, 1, 1], [1, 1]) == [(0, 1), (1, 4)]  # the closest boundary to half the bytes
    assert cut([1, 1, 1], [0, 0, 100]) == [(0, 1), (1, 2), (2, 3)]  # every device keeps at least one layer
    with pytest.raises(ValueError, match="cannot split 2 layers over 3 devices"):
        cut([1, 1], [1, 1, 1])


def test_clef_27b_int8_on_two_24_gib_cards_at_16k(clef, capsys: pytest.CaptureFixture[str]) -> None:
    census = clef.censuses["int8"]
    assert len(census.layers) == 64 and sum(census.layers) + census.text_rest == (
        census.quantized_linears + census.text_other)
    one = clef.plans(CARD_24, context=16_384)["int8"]
    split = split_plan(census, clef.dims, [CARD_24, replace(CARD_24, device="cuda:1")], context=16_384)
    with capsys.disabled():
        print("\n" + "\n".join(render_split(split)))
    assert not one.fits and split.fits
    assert split.ranges == (("cuda:0", 0, 32), ("cuda:1", 32, 64))
    first, last = split.stages
    assert first.layer_weights + last.layer_weights == sum(census.layers)
    assert last.other_weights == census.text_rest + census.head and first.other_weights == 0
    assert first.activations == last.activations == one.activations.total  # every card runs whole-prompt layers
    assert [round(s.need / GiB, 1) for s in split.stages] == [18.5, 19.0]
    assert all(s.need < s.available for s in split.stages)
    # a card twice as large takes about twice the layers
    uneven = split_plan(census, clef.dims, resolve_devices("24GiB,48GiB", {}, resolve_device), context=16_384)
    assert uneven.ranges[0][2] < 25 and uneven.fits


def test_plan_prints_the_split(capsys: pytest.CaptureFixture[str]) -> None:
    code = planner.main(["--config", "clef", "--format", "int8", "--device", "24GiB,24GiB", "--context", "16384"])
    out = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + out)
    assert code == 0
    assert "cuda:0 (a 24 GiB CUDA card): layers 0-31 (32)" in out and "cuda:1 (a 24 GiB CUDA card): layers 32-63" in out
    assert "need 19.0 of 24.0 → fits" in out
    assert planner.main(["--config", "clef", "--format", "int8", "--device", "24GiB,24GiB", "--context", "16384",
                         "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["splits"][0]["stages"]
    assert [s["layers"] for s in stages] == [[0, 32], [32, 64]]
    # an H200 capped to 16 GiB cannot hold Clef 27B int4 at 16K (18.8 GiB even with the prefill in chunks)
    assert planner.main(["--config", "clef", "--format", "int4", "--device", "h200", "--max-memory", "16GiB",
                         "--context", "16384"]) == 1
    out = capsys.readouterr().out
    assert "capped at 16.0 GiB" in out and "nothing fits: the smallest, int4" in out
    assert "int4" in out and "streams from disk" in out  # it does not fit resident; streamed it runs


def test_the_loaders_split_decision(clef) -> None:
    cards = [CARD_24, replace(CARD_24, device="cuda:1")]
    # the loader counts the vision tower on the card (torch loads it) and a card just large enough would run the
    # prefill in 8,192-token chunks (docs/hardware.md#chunked-prefill)
    with pytest.raises(InsufficientMemoryError, match=r"int8 on torch needs 30\.2 GiB .* try --bits 4"):
        plan_load(CARD_24, "int8", clef, context=16_384, installed=TORCH)
    d = plan_split(cards, "int8", clef, context=16_384, installed=TORCH)
    assert (d.device, d.kernel, d.split) == ("cuda:0,cuda:1", "bnb_int8", (("cuda:0", 0, 32), ("cuda:1", 32, 64)))
    small = [with_cap(c, 16 * GiB) for c in cards]
    with pytest.raises(InsufficientMemoryError, match=r"int8 split over cuda:0, cuda:1 needs \d+\.\d \+ \d+\.\d GiB at "
                                                      r"16,384 tokens, 16\.0 \+ 16\.0 GiB free; try --bits 4"):
        plan_split(small, "int8", clef, context=16_384, installed=TORCH)
    with pytest.raises(ApiUsageError, match="torch backend"):
        plan_split(cards, "int8", clef, context=16_384, installed={**TORCH, "onnx": None},
                   options=LoadOptions(backend="onnx"))


def test_move_keeps_structure_and_moves_each_tensor_once() -> None:
    memo: dict[int, tuple[object, object]] = {}
    cos, sin = torch.ones(2, 3), torch.zeros(2, 3)
    meta = torch.device("meta")
    args = move(((cos, sin), {"mask": None, "flag": True, "ids": [cos]}), meta, memo)
    (moved_cos, moved_sin), kwargs = args
    assert moved_cos.device.type == "meta" and moved_sin.shape == (2, 3)
    assert kwargs["ids"][0] is moved_cos and kwargs["mask"] is None and kwargs["flag"] is True
    assert move(cos, meta, memo) is moved_cos and len(memo) == 2
    with pytest.raises(ValueError, match="stage on cpu starts at 3, expected 2"):
        check_stages([("cpu", 0, 2), ("cpu", 3, 4)], 4)
    with pytest.raises(ValueError, match="end at layer 3, the model has 4"):
        check_stages([("cpu", 0, 2), ("cpu", 2, 3)], 4)


@pytest.mark.parametrize("release", ["tiny_qwen", "tiny_llama"])
def test_a_split_over_two_cpu_stages_gives_the_same_numbers(release: str, request: pytest.FixtureRequest) -> None:
    """The pipeline code path (placement, a mover hook on every later layer and the final norm) on one CPU: the
    probabilities are the unsplit run's, bit for bit."""
    path: Path = request.getfixturevalue(release)
    whole = clef_local.load(path, dtype="float32", state_cache=0)  # every record in full, as the split runs them
    split = clef_local.load(path, dtype="float32", device="cpu,cpu")
    assert not split.state_cache.enabled  # a split keeps no state cache (per-device caches are not placed yet)
    described = split.describe()
    assert described["device"] == "cpu,cpu"
    layers = split.backend.backbone.text_model.config.num_hidden_layers
    assert [s["layers"] for s in described["split"]] == [[0, layers // 2], [layers // 2, layers]]
    assert len(split.backend.backbone.pipeline_hooks) == 2 + (layers - layers // 2) + 1
    requests = varied_requests(12, seed=7)[:9]  # they fit tiny_llama's 8,192 tokens
    for a, b in zip(whole.predict(requests), split.predict(requests), strict=True):
        for x, y in zip(a.probabilities, b.probabilities, strict=True):
            np.testing.assert_array_equal(x, y)


def test_load_refuses_what_does_not_fit_under_a_cap(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InsufficientMemoryError, match=r"capped at 0\.1 GiB.*a higher --max-memory for cpu"):
        clef_local.load(tiny_llama, dtype="float32", max_memory={"cpu": "100MiB"})
    with pytest.raises(ApiUsageError, match=r"cannot read the memory size 'lots'"):
        clef_local.load(tiny_llama, max_memory="cpu=lots")
    assert clef_local.load(tiny_llama, dtype="float32", max_memory="cpu=4GiB").backend.load_decision.available_bytes \
        <= 4 * GiB
    from clef_local.cli import main as cli_main

    assert cli_main(["decide", "--model", str(tiny_llama), "--example", "triage", "--max-memory", "cpu=100MiB"]) == 2
    assert "error: bf16 on torch needs" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["24GiB", "24GB", "512MiB", "1.5GB"])
def test_one_size_means_the_same_bytes_everywhere(text: str) -> None:
    """--max-memory, --state-cache and a named device read a size the same way (GiB binary, GB decimal)."""
    from clef_local.runtime.state_cache import parse_size as cache_size
    from clef_local.units import parse_size as bytes_of

    assert parse_size(text) == cache_size(text) == named_device(text).total_bytes == bytes_of(text)
    for ambiguous in ("2G", "2g", "24 gigs"):
        for parse in (parse_size, cache_size, named_device):
            with pytest.raises(ValueError, match=f"cannot read the .* {ambiguous!r}"):
                parse(ambiguous)
