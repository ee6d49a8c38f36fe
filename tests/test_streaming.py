"""Streamed execution (clef_local/backends/streaming.py): the same probabilities as the resident backbone, per backbone
kind, for quantized variants and with images; layer-major reads; the file reader; peak memory under a cap."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import clef_local
from clef_local.backends.torch_backend import TorchBackend
from clef_local.backends.weight_reader import WeightReader
from clef_local.formats.release import read_release
from clef_local.model import ClefModel
from clef_local.planning.load_options import LoadOptions
from clef_local.planning.stream import StreamDecision
from clef_local.runtime.batching import split_by_length
from clef_local.runtime.tokenizer import ReleaseTokenizer

TOLERANCE = 1e-5  # float32: the streamed and resident passes run the same ops on the same weights


@pytest.fixture(scope="module")
def requests() -> list[dict]:
    from request_gen import varied_requests

    return varied_requests(9)[:6]  # short (no edge-size schemas), of different lengths: a streamed batch pads them


def _max_difference(a: ClefModel, b: ClefModel, requests: list[dict]) -> float:
    pa, pb = a.predict(requests), b.predict(requests)
    return max(float(np.max(np.abs(x - y))) for p, q in zip(pa, pb, strict=True)
               for x, y in zip(p.probabilities, q.probabilities, strict=True))


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen"])
def test_streamed_equals_resident_and_reads_each_layer_once_per_batch(kind: str, requests: list[dict],
                                                                      request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(kind)
    resident = clef_local.load(path, dtype="float32", state_cache=0)
    streamed = clef_local.load(path, dtype="float32", offload="disk")
    decision = streamed.describe()["loader"]
    assert decision["stream"] is not None and decision["state_cache_bytes"] == 0
    assert streamed.state_cache.enabled is False
    assert _max_difference(resident, streamed, requests) <= TOLERANCE
    info = streamed.describe()["streamed"]
    layers = info["groups"]
    batches = len(list(split_by_length([len(streamed.encode(r).input_ids) for r in requests], streamed.pad_waste,
                                       max_padded=streamed.batch_tokens)))
    # layer-major: every batch loads each group once, whatever the records in it
    assert info["group_loads"] == layers * batches
    embeddings_rows = info["bytes_read"] - batches * info["layer_bytes"] - info["resident_bytes"]
    assert 0 <= embeddings_rows < info["layer_bytes"]  # the rest are the rows a batch gathers
    assert streamed.describe()["embeddings"] == "file"


VARIANTS = {"llama-int4": ("tiny_llama", "int4"), "llama-int8": ("tiny_llama", "int8"),
            "qwen3_5-int4": ("tiny_qwen", "int4")}  # the gated delta net once: its float32 prefill is the slow one


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_streamed_variants_equal_resident(name: str, requests: list[dict], request: pytest.FixtureRequest,
                                          tmp_path: Path) -> None:
    from clef_local.export.quantize import quantize_release

    source, scheme = VARIANTS[name]
    variant = quantize_release(request.getfixturevalue(source), tmp_path / name, scheme, validate=False,
                               log_summary=False)["out"]
    resident = clef_local.load(variant, dtype="float32", state_cache=0)
    streamed = clef_local.load(variant, dtype="float32", offload="disk")
    assert _max_difference(resident, streamed, requests[:4]) <= TOLERANCE
    assert set(streamed.describe()["kernels"]) == {f"{scheme}:dequantize"}  # no per-load repack


def _streamed_model(path: Path, vision: str) -> ClefModel:
    release = read_release(path)
    decision = StreamDecision(group_layers=2, vision=vision, batch_tokens=1 << 14, pad_waste=1.5, peak_bytes=0,
                              available_bytes=0, read_bytes=0)
    backend = TorchBackend(release, device="cpu", dtype="float32", stream=decision)
    return ClefModel(release, backend, ReleaseTokenizer(release.path))


@pytest.mark.parametrize("vision", ["resident", "streamed"])
def test_streamed_with_images_equals_resident(tiny_vision: Path, vision: str) -> None:
    from media_gen import vision_requests

    batch = [*vision_requests(2), {"model": "m", "state": "no image here", "questions": {
        "q": {"type": "noul", "instructions": "Is there a photo?"}}}]
    resident = clef_local.load(tiny_vision, dtype="float32", state_cache=0)
    streamed = _streamed_model(tiny_vision, vision)
    assert _max_difference(resident, streamed, batch) <= TOLERANCE
    info = streamed.describe()["streamed"]
    assert info["vision"] == ("streamed" if vision == "streamed" else "resident or none")
    assert info["groups"] == 2  # four layers in groups of two


def test_reader_reads_tensors_and_rows_as_stored(tiny_qwen: Path) -> None:
    files = read_release(tiny_qwen).weight_files
    reader = WeightReader(files)
    stored = {k: v for f in files for k, v in load_file(f).items()}
    name = next(n for n in stored if n.endswith("embed_tokens.weight"))
    for key in (name, next(n for n in stored if ".layers.0." in n and n.endswith("proj.weight"))):
        assert torch.equal(reader.read(key), stored[key])
    assert reader.read(name, torch.float32).dtype == torch.float32
    ids = torch.tensor([[5, 6, 7, 3], [3, 3, 40, 6]])
    assert torch.equal(reader.rows(name, ids), stored[name][ids])
    before = reader.bytes_read
    reader.rows(name, torch.tensor([9, 10, 11, 30]))  # two runs of consecutive rows, four distinct rows
    assert reader.bytes_read - before == 4 * stored[name][0].numel() * stored[name].element_size()
    with pytest.raises(ValueError, match="outside"):
        reader.rows(name, torch.tensor([stored[name].shape[0]]))


def test_batches_stop_at_the_padded_budget() -> None:
    costs = [10, 10, 10, 12, 12, 40]
    assert split_by_length(costs, 1.5, max_padded=36) == [[0, 1, 2], [3, 4], [5]]
    assert split_by_length(costs, 1.5, max_padded=5) == [[0], [1], [2], [3], [4], [5]]  # alone, over the budget
    with pytest.raises(ValueError, match="max_padded"):
        split_by_length(costs, 1.5, max_padded=0)


def test_a_streamed_model_batches_by_its_token_budget(tiny_llama: Path, requests: list[dict]) -> None:
    model = clef_local.load(tiny_llama, dtype="float32", offload="disk")
    model.batch_tokens = 2 * max(len(model.encode(r).input_ids) for r in requests)
    sizes = [len(chunk) for chunk, _ in model.run([model.encode(r) for r in requests], batch_size=1)]
    assert max(sizes) == 2 and sum(sizes) == len(requests)  # batch_size=1 is not what cuts a streamed batch


_PEAK = """
import json, sys
import clef_local
from clef_local.data.probes import probe_requests
model = clef_local.load(sys.argv[1], dtype="float32", state_cache=0, **json.loads(sys.argv[2]))
model.predict(probe_requests(8))
# VmHWM, not getrusage's ru_maxrss: Linux carries the parent's high-water mark into a forked and exec'd child, so in
# the full suite ru_maxrss read the pytest process's few GB, not this child's peak
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak": peak, "loader": model.describe()["loader"]}))
"""


def _peak(path: Path, options: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", _PEAK, str(path), json.dumps(options)], capture_output=True,
                          text=True, check=True, timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc (Linux)")
def test_streamed_peak_memory_stays_under_a_cap_below_the_resident_need(demo_release: Path) -> None:
    """The demo model in float32 (its weights ~0.54 GB as run) under a cap between its streamed and its resident
    plan: the load streams (offload auto), and the process's peak RSS stays under the cap and far under the resident
    run's."""
    from clef_local.backends.loader import plan_backend

    release = read_release(demo_release)
    need = plan_backend(release, LoadOptions(dtype="float32", state_cache=0)).need_bytes
    streamed_need = plan_backend(release, LoadOptions(dtype="float32", state_cache=0, offload="disk")).need_bytes
    assert streamed_need < need
    cap = (need + streamed_need) // 2  # below what the resident plan needs
    resident = _peak(demo_release, {})
    assert resident["loader"]["need_bytes"] == need
    weights = release.weight_bytes * 2  # bf16 stored, float32 as run
    streamed = _peak(demo_release, {"max_memory": f"cpu={cap}", "offload": "auto"})
    stream = streamed["loader"]["stream"]
    assert stream is not None and streamed["loader"]["need_bytes"] == streamed_need
    assert streamed["peak"] <= cap, (streamed["peak"], cap)
    assert streamed["peak"] < resident["peak"] - weights // 2, (streamed["peak"], resident["peak"])


@pytest.fixture
def bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU as one where BF16 is fast, so that ``auto`` is bfloat16 on every machine: the tiny releases' streamed
    plan undercuts their resident one in BF16 only (in float32 the planner counts a resident BF16 release at its
    stored size, a streamed one as loaded)."""
    from clef_local.planning import hardware

    real = hardware.detect
    monkeypatch.setattr(hardware, "detect", lambda device="auto", **kw: replace(real(device, **kw), bf16=True,
                                                                                 fast_bf16=True))


def _cap_between(path: Path) -> int:
    """A memory cap under the resident plan of ``path`` (no state cache) and over its streamed one."""
    from clef_local.backends.loader import plan_backend

    release = read_release(path)
    resident = plan_backend(release, LoadOptions(state_cache=0))
    streamed = plan_backend(release, LoadOptions(offload="disk"))
    assert resident.dtype == streamed.dtype == "bfloat16" and streamed.stream is not None
    assert streamed.need_bytes < resident.need_bytes
    return (resident.need_bytes + streamed.need_bytes) // 2


def test_offload_none_refuses_with_the_streamed_option(tiny_llama: Path, bf16_cpu: None) -> None:
    from clef_local.backends.loader import plan_backend
    from clef_local.errors import InsufficientMemoryError

    release = read_release(tiny_llama)
    cap = f"cpu={_cap_between(tiny_llama)}"
    with pytest.raises(InsufficientMemoryError, match=r"or stream it from disk: --offload disk.*peak [0-9.]+ GiB"):
        plan_backend(release, LoadOptions(max_memory=cap))
    auto = plan_backend(release, LoadOptions(max_memory=cap, offload="auto"))
    assert auto.stream is not None and "streamed from disk: resident it needs" in auto.reason
    assert auto.stream.batch_tokens == 8192  # the cap leaves room for one record at the context, no more


@pytest.mark.slow
def test_reference_runs_stream_by_themselves_under_a_cap(tiny_llama: Path, tmp_path: Path, bf16_cpu: None,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """drift and quantize's validation under a cap the reference's resident plan does not fit: each streams it
    (one line says so) and finishes; decide under the same cap refuses unless asked (--offload disk)."""
    import logging

    from clef_local.errors import InsufficientMemoryError
    from clef_local.export.quantize import quantize_release
    from clef_local.quality.drift_cli import main as drift_main

    cap = f"cpu={_cap_between(tiny_llama)}"
    with pytest.raises(InsufficientMemoryError, match="or stream it from disk"):
        clef_local.load(tiny_llama, max_memory=cap)
    assert clef_local.load(tiny_llama, max_memory=cap, offload="disk").describe()["streamed"]
    with caplog.at_level(logging.INFO):
        summary = quantize_release(tiny_llama, tmp_path / "int8", "int8", max_memory=cap, log_summary=False)
    assert summary["validation"]["passed"]
    assert "reference streamed from disk: peak" in caplog.text and " GB per pass" in caplog.text
    # validation.json says how the reference ran: every group of layers read once per pass, nothing skipped
    ran = json.loads((tmp_path / "int8" / "validation.json").read_text())["runs"]["reference"]
    streamed = ran["streamed"]
    assert ran["batches"] >= 1 and streamed["group_loads"] == streamed["groups"] * ran["batches"]
    assert streamed["bytes_read"] >= streamed["layer_bytes"] * ran["batches"]
    passes = f"{ran['batches']} pass{'' if ran['batches'] == 1 else 'es'}"
    assert f"reference streamed from disk: {streamed['bytes_read'] / 1e9:.2f} GB read in {passes}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert drift_main(["--reference", str(tiny_llama), "--candidate", str(tmp_path / "int8"), "--limit", "4",
                           "--max-memory", cap, "--no-progress"]) == 0
    assert "reference streamed from disk: peak" in caplog.text
