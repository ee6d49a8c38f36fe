"""Length-bucketed batches: padding bounded per device, and the model's batches follow the bound."""

from __future__ import annotations

import pytest
import torch

import clef_local
from clef_local.runtime.batching import CPU_PAD_WASTE, PAD_WASTE, device_pad_waste, split_by_length


def padded_over_real(costs: list[float], groups: list[list[int]]) -> float:
    return max(len(g) * max(costs[i] for i in g) / sum(costs[i] for i in g) for g in groups)


def test_split_bounds_padding_and_size() -> None:
    assert split_by_length([300, 310, 320, 7000]) == [[0, 1, 2], [3]]
    assert split_by_length([7000, 300, 7100, 320]) == [[1, 3], [0, 2]]
    assert split_by_length([500] * 8) == [list(range(8))]
    assert split_by_length([500] * 8, max_size=3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    costs = [444, 294, 325, 444, 294, 325, 294, 325]  # the three example requests' token counts, mixed
    assert split_by_length(costs, CPU_PAD_WASTE) == [[1, 4, 6], [2, 5, 7], [0, 3]]
    assert split_by_length(costs, PAD_WASTE) == [[1, 4, 6, 2, 5, 7, 0, 3]]  # 1.22× padding: one batch
    for waste in (1.0, 1.05, 1.5, 3.0):
        groups = split_by_length(costs, waste)
        assert sorted(i for g in groups for i in g) == list(range(8))
        assert padded_over_real(costs, groups) <= waste + 1e-9


def test_split_refuses_impossible_bounds() -> None:
    with pytest.raises(ValueError, match=r"must be ≥ 1, got 0\.5"):
        split_by_length([1, 2], 0.5)
    with pytest.raises(ValueError, match="max_size must be ≥ 1, got 0"):
        split_by_length([1, 2], max_size=0)


def test_devices_get_their_budget() -> None:
    assert device_pad_waste(torch.device("cpu")) == CPU_PAD_WASTE
    assert device_pad_waste("cpu") == CPU_PAD_WASTE
    assert device_pad_waste("Device(cpu, 0)") == CPU_PAD_WASTE  # MLX's CPU device
    assert device_pad_waste(torch.device("cuda", 0)) == PAD_WASTE
    assert device_pad_waste("Device(gpu, 0)") == PAD_WASTE


def test_batches_follow_the_device_budget(tiny_qwen, monkeypatch) -> None:
    model = clef_local.load(tiny_qwen)
    assert model.pad_waste == CPU_PAD_WASTE  # these tests run on the CPU backend
    short = {"model": "m", "state": "short", "questions": {"ok": {"type": "noul"}}}
    long = {"model": "m", "state": "a longer state " * 10, "questions": {"ok": {"type": "noul"}}}
    sizes: list[list[int]] = []
    original = model.backend.logits

    def spy(records, *args):
        sizes.append([len(r.input_ids) for r in records])
        return original(records, *args)

    monkeypatch.setattr(model.backend, "logits", spy)
    out = model.predict([short, long, short, long, short], batch_size=8)
    assert sorted(map(sorted, sizes)) == sorted([[len(out[0].encoded.input_ids)] * 3,
                                                 [len(out[1].encoded.input_ids)] * 2])
    sizes.clear()
    model.pad_waste = float("inf")
    model.predict([short, long, short, long, short], batch_size=2)
    assert [len(s) for s in sizes] == [2, 2, 1]


def test_run_batches_and_progress(tiny_qwen) -> None:
    """Each request lands in exactly one batch, results come back in request order, progress counts requests, and a
    bad request raises before any batch runs (so eval/drift never spend time on a set they cannot finish)."""
    from clef_local.errors import RequestValidationError

    model = clef_local.load(tiny_qwen)
    requests = [{"model": "m", "state": "x" * n, "questions": {"q": {"type": "noul"}}} for n in (3, 40, 3, 9, 40)]
    batches = list(model.run([model.encode(r) for r in requests], batch_size=2))
    assert sorted(i for chunk, _ in batches for i in chunk) == list(range(5))
    assert all(len(chunk) <= 2 for chunk, _ in batches)
    seen: list[tuple[int, int]] = []
    out = model.predict(requests, batch_size=2, progress=lambda done, total: seen.append((done, total)))
    assert [p.request.state for p in out] == [r["state"] for r in requests]
    assert seen[-1] == (5, 5) and [d for d, _ in seen] == sorted(d for d, _ in seen) and len(seen) == len(batches)
    for chunk, predictions in batches:
        for i, prediction in zip(chunk, predictions, strict=True):
            assert prediction.request.state == requests[i]["state"]
            assert all((p == q).all() for p, q in zip(prediction.probabilities, out[i].probabilities, strict=True))
    calls = []
    model.backend.logits = lambda *a: calls.append(a)  # type: ignore[method-assign]
    with pytest.raises(RequestValidationError):
        model.predict([*requests, {"model": "m", "state": "s", "questions": {}}])
    assert not calls  # no batch ran
    with pytest.raises(ValueError, match="batch_size"):
        next(model.run([model.encode(requests[0])], batch_size=0))
