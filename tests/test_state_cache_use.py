"""Where the state cache is used and sized: the server (flag, /metrics), the UI's handlers, eval rows sharing a
state, the planner's budget, doctor, and the backends that do not have it."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import clef_local
from clef_local.data.datasets import Example
from clef_local.errors import ApiUsageError, InsufficientMemoryError
from clef_local.planning.choice import STATE_CACHE_BACKENDS, UNPLANNED_STATE_CACHE, plan_load
from clef_local.planning.estimate import STATE_CACHE_CAP, ModelDims, plan, state_entry_bytes
from clef_local.planning.hardware import named_device
from clef_local.planning.load_options import LoadOptions
from clef_local.planning.planner import footprint_from_config, packaged_config
from clef_local.runtime.answers import round_floats
from clef_local.runtime.state_cache import StateCache
from clef_local.server import ServerConfig, ThreadedServer, create_app
from clef_local.units import GiB

STATE = {"ticket": 4711, "thread": ["My card was charged twice for one coffee.", "Still no refund after a week."]}
SCHEMAS: list[dict[str, Any]] = [
    {"refund": {"type": "noul", "instructions": "Does the customer want money back?"}},
    {"team": {"type": "choice", "criteria": {"cards": "Card payments", "transfers": None, "other": None}}},
    {"urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
     "angry": {"type": "noul", "instructions": "Is the customer angry?"}},
]
ALL = {"torch": None, "mlx": None, "onnx": None}


def _requests(states: list[Any]) -> list[dict[str, Any]]:
    return [{"model": "m", "state": state, "questions": schema} for state in states for schema in SCHEMAS]


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_the_server_counts_hits_misses_and_bytes(tiny_llama: Path) -> None:
    model = clef_local.load(tiny_llama, dtype="float32", state_cache="16MiB")
    cold = clef_local.load(tiny_llama, dtype="float32", state_cache=0)
    requests = _requests([STATE, "Where is my new card?"])
    with ThreadedServer(create_app({"m": model}, ServerConfig(max_batch=1))) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        answers = [client.post("/v1/systemone", json=r).json() for r in requests]
        samples = _samples(client.get("/metrics").text)
    assert samples['clef_state_cache_misses_total{model="m"}'] == 2
    assert samples['clef_state_cache_hits_total{model="m"}'] == 4
    assert samples['clef_state_cache_entries{memory="device",model="m"}'] == 2
    assert samples['clef_state_cache_bytes{memory="device",model="m"}'] == model.state_cache.stats().bytes > 0
    assert samples['clef_state_cache_budget_bytes{memory="device",model="m"}'] == 16 << 20
    assert samples['clef_state_cache_evictions_total{model="m"}'] == 0
    expected = [json.loads(json.dumps(round_floats(cold.decide(r)))) for r in requests]
    assert answers == expected  # the wire's 4 decimals: a hit answers exactly what a cold pass does


def test_serve_takes_a_state_cache_size(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import clef_local.server.run as run
    from clef_local.cli import main

    seen: dict[str, Any] = {}
    serve = run.serve
    monkeypatch.setattr(run, "serve", lambda specs, **kwargs: seen.update(kwargs) or 0)
    assert main(["serve", "--state-cache", "512MiB"]) == 0 and seen["state_cache"] == 512 << 20
    assert main(["serve", "--state-cache", "0"]) == 0 and seen["state_cache"] == 0
    assert main(["serve"]) == 0 and seen["state_cache"] is None  # sized by the planner
    with pytest.raises(SystemExit) as info:
        main(["serve", "--state-cache", "lots"])
    assert info.value.code == 2
    assert "--state-cache" in capsys.readouterr().err
    with pytest.raises(ApiUsageError, match="--state-cache"):
        ServerConfig(state_cache=-1)
    loaded: dict[str, Any] = {}
    monkeypatch.setattr(run, "load_models", lambda specs, **kw: loaded.update(kw) or {})
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)  # nothing is bound
    monkeypatch.setattr("clef_local.server.app.create_app", lambda models, config: None)
    serve(["m=/some/release"], state_cache=1 << 20)
    assert loaded["state_cache"] == 1 << 20


def test_the_ui_reruns_only_the_schema(tiny_qwen: Path) -> None:
    from clef_local.app.handlers import Handlers
    from clef_local.app.models import ModelStore

    handlers = Handlers(ModelStore(tiny_qwen, []))
    cold = clef_local.load(tiny_qwen, state_cache=0)  # the app's dtype: the loader's choice
    outputs = [handlers.run_request(r, str(tiny_qwen), "") for r in _requests([STATE])]
    model = handlers.store.get(tiny_qwen)
    stats = model.state_cache.stats()
    assert (stats.misses, stats.hits) == (1, 2)  # editing the schema re-ran only the schema
    assert ["only the schema ran" in output[1] for output in outputs] == [False, True, True]  # the status line
    for output, request in zip(outputs, _requests([STATE]), strict=True):
        raw = json.loads(output[4])  # the raw response panel
        want = cold.decide(request)
        for qid, answer in raw["answers"].items():
            for key in ("noul", "score"):
                if key in answer:
                    assert answer[key] == pytest.approx(want["answers"][qid][key], abs=2e-2)


def test_eval_rows_sharing_a_state_run_it_once(tiny_llama: Path) -> None:
    from clef_local.quality.evaluate import evaluate

    model = clef_local.load(tiny_llama, dtype="float32", state_cache="16MiB")
    cold = clef_local.load(tiny_llama, dtype="float32", state_cache=0)
    examples = [Example(str(i), r, {}) for i, r in enumerate(_requests([STATE, "Card stuck in the ATM."]))]
    _, predictions = evaluate(model, examples, batch_size=4)
    assert model.state_cache.stats().misses == 2 and model.state_cache.stats().hits == 4
    _, reference = evaluate(cold, examples, batch_size=4)
    worst = max(float(np.abs(a - b).max()) for p, q in zip(predictions, reference, strict=True)
                for a, b in zip(p.probabilities, q.probabilities, strict=True))
    assert worst <= 1e-5


def test_the_planner_counts_the_budget() -> None:
    footprint = footprint_from_config(packaged_config("clef-flash"))
    dims = footprint.dims
    card = named_device("l4")
    bare = plan(footprint.censuses["bf16"], dims, card, context=16384)
    cached = plan(footprint.censuses["bf16"], dims, card, context=16384, state_cache=GiB)
    entry = state_entry_bytes(dims, 16384, "bfloat16")
    assert cached.need - bare.need == GiB + entry and cached.to_json()["state_cache_bytes"] == GiB + entry
    # Clef-flash: 16 full-attention layers of 4 × 256 keys/values, 48 linear ones (conv + float32 recurrent state)
    assert dims.linear_layers and dims.linear_conv_kernel == 4
    assert entry == 16384 * 2 * (dims.hidden + (dims.layers - dims.linear_layers) * 2 * dims.kv_heads
                                 * dims.head_dim) + state_entry_bytes(dims, 0, "bfloat16")
    auto = plan_load(card, "bf16", footprint, context=16384, installed=ALL,
                     options=LoadOptions(dtype="bfloat16", state_cache=None))  # None: sized by the planner
    assert 0 < auto.state_cache_bytes <= STATE_CACHE_CAP
    assert auto.need_bytes is not None and auto.available_bytes is not None
    assert auto.need_bytes <= auto.available_bytes
    asked = plan_load(card, "bf16", footprint, context=16384, installed=ALL,
                      options=LoadOptions(dtype="bfloat16", state_cache=GiB))
    off = plan_load(card, "bf16", footprint, context=16384, installed=ALL,
                    options=LoadOptions(dtype="bfloat16", state_cache=0))
    assert asked.state_cache_bytes == GiB and off.state_cache_bytes == 0
    assert asked.need_bytes is not None and off.need_bytes is not None
    assert asked.need_bytes - off.need_bytes == GiB + entry
    with pytest.raises(InsufficientMemoryError, match=r"state cache of 20\.00 GiB.*ask for at most .* GiB"):
        plan_load(card, "bf16", footprint, context=16384, installed=ALL,
                  options=LoadOptions(dtype="bfloat16", state_cache=20 * GiB))
    mac = named_device("mac-36")
    assert plan_load(mac, "int4", footprint, context=16384, installed=ALL,
                     options=LoadOptions(backend="mlx", state_cache=GiB)).state_cache_bytes == 0  # torch only
    assert STATE_CACHE_BACKENDS == ("torch",)
    unplanned = plan_load(card, "bf16", None, context=16384, installed=ALL,
                          options=LoadOptions(check_memory=False, state_cache=None))
    assert unplanned.state_cache_bytes == UNPLANNED_STATE_CACHE


def test_the_planners_entry_matches_a_real_entry(tiny_qwen: Path) -> None:
    model = clef_local.load(tiny_qwen, dtype="float32", state_cache="16MiB")
    model.decide(_requests([STATE])[0])
    (size,) = model.state_cache.sizes().values()
    tokens = model.encode(_requests([STATE])[0])
    dims = ModelDims.from_config(model.release.config)
    assert size == state_entry_bytes(dims, tokens.state_start + tokens.state_tokens, "float32")
    assert model.describe()["state_cache"] == {"budget_bytes": 16 << 20, "spill_bytes": 0}


def test_doctor_says_torch_only() -> None:
    from clef_local.planning.doctor import render, report

    info = report(probe=False)
    assert info["state_cache"]["torch"] == "yes"
    assert info["state_cache"]["mlx"].startswith("torch only") and info["state_cache"]["onnx"].startswith("torch only")
    assert re.search(r"onnx +torch only: the ONNX export has no past key/value inputs", render(info))


class _NoCacheBackend:
    """A backend that cannot continue a pass (as MLX and ONNX Runtime): wraps a torch one's ``logits``."""

    accepts_media = False
    media_refusal = None
    state_cache_blocker = "the ONNX Runtime backend runs every state in full (the state cache is torch's)"
    prefill = None  # no memory plan: every pass in one piece
    batch_tokens = pad_waste = None

    def __init__(self, inner: Any) -> None:
        self.name, self.release, self.device, self.load_decision = "onnx", inner.release, inner.device, None
        self.inner = inner
        self.calls = 0

    def logits(self, records: Any, layout: Any, pad_token_id: int, cache: Any = None) -> Any:
        assert cache is None, "a cache was passed to a backend that cannot use one"
        self.calls += 1
        return self.inner.logits(records, layout, pad_token_id)

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


def test_backends_without_a_cache_run_every_state(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    loaded = clef_local.load(tiny_llama, dtype="float32", state_cache=0)
    backend = _NoCacheBackend(loaded.backend)
    with caplog.at_level(logging.INFO, logger="clef_local.model"):
        model = clef_local.ClefModel(loaded.release, backend, loaded.tokenizer, state_cache=1 << 20)  # type: ignore[arg-type]
    assert "state cache off: the ONNX Runtime backend runs every state" in caplog.text
    assert not model.state_cache.enabled
    model.predict(_requests([STATE]))
    stats = model.state_cache.stats()
    assert backend.calls > 0 and stats.misses == stats.hits == 0


def test_spill_is_for_accelerators(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="state_cache_spill is host memory"):
        clef_local.load(tiny_llama, dtype="float32", state_cache="1MiB", state_cache_spill="1MiB")
    with pytest.raises(ValueError, match="cannot read the state cache size"):
        clef_local.load(tiny_llama, state_cache="a lot")
    assert not StateCache(0).enabled
