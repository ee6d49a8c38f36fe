"""Streamed plans (clef_local/planning/stream.py) with the packaged Clef shapes on faked machines: who streams, the
terms of the peak, the refusals, `plan`'s table, and the read-rate probe."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from clef_local.errors import ApiUsageError, InsufficientMemoryError
from clef_local.planning import read_probe
from clef_local.planning.choice import plan_load
from clef_local.planning.hardware import Hardware, named_device
from clef_local.planning.load_options import LoadOptions
from clef_local.planning.planner import CONFIGS_DIR, footprint_from_config
from clef_local.planning.planner import main as plan_main
from clef_local.planning.stream import MAX_BATCH_TOKENS, loaded_growth, stream_plan
from clef_local.units import GiB

ALL = {"torch": None, "mlx": None, "onnx": None}
CPU_8 = Hardware(kind="cpu", name="an 8 GB box", device="cpu", total_bytes=8 * GiB, free_bytes=8 * GiB, bf16=True,
                 fast_bf16=True, cores=4, host_total_bytes=8 * GiB, host_free_bytes=8 * GiB)


@pytest.fixture(scope="module")
def flash():
    return footprint_from_config(CONFIGS_DIR / "clef-flash.config.json")


def test_a_reference_that_does_not_fit_streams_with_auto_only(flash) -> None:
    with pytest.raises(InsufficientMemoryError, match=r"or stream it from disk: --offload disk"):
        plan_load(CPU_8, "bf16", flash, context=16_384, installed=ALL)
    decision = plan_load(CPU_8, "bf16", flash, context=16_384, installed=ALL, options=LoadOptions(offload="auto"))
    stream = decision.stream
    assert stream is not None and decision.backend == "torch" and decision.state_cache_bytes == 0
    census = flash.censuses["bf16"]
    assert stream.read_bytes == sum(census.layers)  # every decoder layer once per pass
    assert 17e9 < census.backbone < 20e9 and stream.read_bytes < census.backbone  # embeddings are not read whole
    assert stream.need_bytes <= stream.peak_bytes <= stream.available_bytes == 8 * GiB
    assert decision.need_bytes == stream.need_bytes
    assert stream.batch_tokens >= 16_384 and stream.batch_tokens % 16_384 == 0
    resident = plan_load(named_device("h200"), "bf16", flash, context=16_384, installed=ALL,
                         options=LoadOptions(offload="auto"))
    assert resident.stream is None  # auto streams only what does not fit


def test_the_peak_is_its_terms(flash) -> None:
    census = flash.censuses["bf16"]
    sp = stream_plan(census, flash.dims, CPU_8, context=16_384, dtype="bfloat16")
    assert loaded_growth(census, "bfloat16") == 1.0 and loaded_growth(census, "float32") == 2.0
    assert sp.group == max(census.layers) and sp.groups == 2 * sp.group  # one layer per group, bf16 as stored
    assert sp.vision == "resident" and sp.resident == census.head + census.text_rest + census.vision
    terms = sp.resident + sp.groups + sp.transient + sp.activations.total + sp.overhead
    assert terms < sp.need < terms * 1.06  # + the 5 % margin
    assert sp.batch_tokens <= MAX_BATCH_TOKENS and sp.peak <= sp.available < sp.need + sp.activations.total * 4
    tight = replace(CPU_8, free_bytes=int(sp.need - sp.resident + census.vision // 2))
    squeezed = stream_plan(census, flash.dims, tight, context=16_384, dtype="bfloat16")
    assert squeezed.vision == "streamed" and squeezed.vision_read_bytes == census.vision  # one more group
    assert squeezed.groups == max(2 * squeezed.group, census.vision + squeezed.group)
    int4 = stream_plan(flash.censuses["int4"], flash.dims, CPU_8, context=16_384, dtype="bfloat16")
    assert int4.read_bytes < sp.read_bytes / 3 and int4.group < sp.group / 3


def test_nothing_fits_even_streamed_and_disk_needs_torch(flash) -> None:
    tiny = replace(CPU_8, free_bytes=GiB, total_bytes=GiB, name="a 1 GB box")
    with pytest.raises(InsufficientMemoryError, match=r"bf16 does not fit on cpu \(a 1 GB box\) even streamed from "
                                                      r"disk: it needs [0-9.]+ GiB at 16,384 tokens"):
        plan_load(tiny, "bf16", flash, context=16_384, installed=ALL, options=LoadOptions(offload="auto"))
    with pytest.raises(ApiUsageError, match="streaming from disk runs on the torch backend, not mlx"):
        plan_load(named_device("mac-36"), "bf16", flash, context=16_384, installed=ALL,
                  options=LoadOptions(backend="mlx", offload="disk"))
    mac = plan_load(named_device("mac-36"), "bf16", flash, context=16_384, installed=ALL,
                    options=LoadOptions(offload="disk"))
    assert (mac.backend, mac.device) == ("torch", "cpu") and "only it streams" in mac.reason
    with pytest.raises(ApiUsageError, match="offload must be one of none, auto, disk"):
        plan_load(CPU_8, "bf16", flash, context=16_384, installed=ALL, options=LoadOptions(offload="yes"))


def test_plan_prints_resident_streamed_or_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    # at 16K: a streamed pass is not chunked, so at 64K its activations alone outgrow 16 GB
    flags = ["--config", "clef-flash", "--device", "cpu-16", "--dtype", "bfloat16", "--context", "16384"]
    assert plan_main([*flags, "--read-rate", "2GB/s"]) == 0  # int8 and smaller fit resident
    out = capsys.readouterr().out
    verdicts = {line.split()[0]: line.split("  ")[-1].split(" (prefill in")[0].strip()
                for line in out.splitlines()[4:9]}
    assert verdicts == {"bf16": "streams from disk", "int8": "fits", "fp8": "fits", "int4": "fits", "nf4": "fits"}
    assert "streamed from disk (decoder layers read a group at a time" in out and "2.00 GB/s, given" in out
    assert plan_main([*flags[:-2], "--context", "262144"]) == 1  # no format at all: not even streamed
    assert capsys.readouterr().out.count("does not fit") == 10
    assert plan_main([*flags, "--json", "--read-rate", "2GB"]) == 0
    data = json.loads(capsys.readouterr().out)
    bf16 = next(p for p in data["streamed"] if p["format"] == "bf16")
    assert bf16["fits"] and bf16["read_seconds_per_pass"] == pytest.approx(bf16["read_bytes_per_pass"] / 2e9)
    assert plan_main(["--config", "clef-flash", "--read-rate", "fast"]) == 2


def test_the_read_rate_is_measured_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "weights.bin"
    file.write_bytes(b"\0" * (2 << 20))
    monkeypatch.setattr(read_probe, "MIN_BYTES", 1 << 20)
    first = read_probe.read_rate(file, cache=tmp_path)
    assert first.bytes_per_second > 0 and first.source.startswith("measured 20")
    monkeypatch.setattr(read_probe, "measure", lambda *a: pytest.fail("measured twice"))
    again = read_probe.read_rate(file, cache=tmp_path)
    assert again.bytes_per_second == pytest.approx(first.bytes_per_second, rel=1e-6) and "cached" in again.source
    assert read_probe.given("3GB/s").bytes_per_second == 3e9
    with pytest.raises(ValueError):
        read_probe.given("0GB")
