"""dtype="auto" on a CPU follows a one-off measurement of BF16 against float32, cached per CPU and torch version
(clef_local.planning.dtype_probe), never the CPU's flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clef_local.planning import doctor, dtype_probe, hardware
from clef_local.planning.choice import choose

ALL = {"torch": None, "mlx": None, "onnx": None}


class FakeRun:
    """A measurement that returns fixed timings and counts its calls."""

    def __init__(self, float32_ms: float, bfloat16_ms: float) -> None:
        self.timings = (float32_ms, bfloat16_ms)
        self.calls = 0

    def __call__(self) -> tuple[float, float]:
        self.calls += 1
        return self.timings


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CLEF_LOCAL_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(("float32_ms", "bfloat16_ms", "dtype"), [
    (10.0, 4.0, "bfloat16"),  # bf16 2.5x faster: an AVX512-BF16 CPU without AMX
    (4.0, 10.0, "float32"),  # bf16 2.5x slower
    (10.0, 9.5, "float32"),  # within the margin: float32's precision wins the tie
])
def test_auto_dtype_follows_the_measurement_either_way(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                       float32_ms: float, bfloat16_ms: float, dtype: str) -> None:
    run = FakeRun(float32_ms, bfloat16_ms)
    monkeypatch.setattr(dtype_probe, "measure", run)
    monkeypatch.setattr(hardware, "cpu_flags_and_name", lambda: (("avx512_bf16", "avx512f"), "Test CPU 9000"))
    assert hardware.detect_cpu().bf16_speedup is None  # detection alone never measures
    assert choose(hardware.detect_cpu(), "bf16", installed=ALL).dtype == "float32"
    cpu = hardware.detect_cpu(measure_bf16=True)
    assert run.calls == 1
    assert cpu.bf16_speedup == pytest.approx(float32_ms / bfloat16_ms)
    decision = choose(cpu, "bf16", installed=ALL)
    assert decision.dtype == dtype and f"{float32_ms / bfloat16_ms:.2f}x" in decision.reason
    # cached: the next process reads it without measuring, even without being asked to measure
    assert hardware.detect_cpu(measure_bf16=True).bf16_speedup == cpu.bf16_speedup
    assert hardware.detect_cpu().fast_bf16 is (dtype == "bfloat16")
    assert run.calls == 1
    entries = json.loads((cache / dtype_probe.PROBE_FILE).read_text())
    (entry,) = entries.values()
    assert (entry["cpu"], entry["float32_ms"], entry["bfloat16_ms"]) == ("Test CPU 9000", float32_ms, bfloat16_ms)


def test_another_cpu_or_torch_version_is_measured_again(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = FakeRun(10.0, 5.0)
    flags = ("avx2",)
    first = dtype_probe.bf16_probe("CPU A", flags, run=run)
    assert first is not None and first.bf16_faster and run.calls == 1
    assert dtype_probe.bf16_probe("CPU A", flags, run=run) == first and run.calls == 1
    dtype_probe.bf16_probe("CPU B", flags, run=run)
    dtype_probe.bf16_probe("CPU A", ("avx2", "amx_bf16"), run=run)
    assert run.calls == 3
    monkeypatch.setattr(dtype_probe, "torch_version", lambda: "99.0")
    assert dtype_probe.cached_probe("CPU A", flags) is None
    dtype_probe.bf16_probe("CPU A", flags, run=run)
    assert run.calls == 4
    assert len(json.loads((cache / dtype_probe.PROBE_FILE).read_text())) == 4


def test_without_torch_nothing_is_measured_and_auto_is_float32(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = FakeRun(10.0, 1.0)
    monkeypatch.setattr(dtype_probe, "torch_version", lambda: None)
    assert dtype_probe.bf16_probe("CPU A", (), run=run) is None and run.calls == 0
    monkeypatch.setattr(dtype_probe, "measure", run)
    cpu = hardware.detect_cpu(measure_bf16=True)
    assert cpu.bf16_speedup is None and not cpu.fast_bf16
    assert choose(cpu, "bf16", installed=ALL).dtype == "float32"


def test_an_unreadable_cache_is_measured_again_and_rewritten(cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    (cache / dtype_probe.PROBE_FILE).write_text("{not json")
    run = FakeRun(3.0, 6.0)
    probe = dtype_probe.bf16_probe("CPU A", (), run=run)
    assert probe is not None and not probe.bf16_faster and run.calls == 1
    assert "unreadable" in caplog.text
    assert probe.key in json.loads((cache / dtype_probe.PROBE_FILE).read_text())


def test_the_real_probe_times_both_dtypes_in_about_a_second() -> None:
    import time

    started = time.perf_counter()
    float32_ms, bfloat16_ms = dtype_probe.measure()
    assert 0 < float32_ms < 5_000 and 0 < bfloat16_ms < 5_000
    assert time.perf_counter() - started < 30  # a shared CI machine may be slow; here it is ~1 s


def test_doctor_shows_the_measurement(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(dtype_probe, "measure", FakeRun(10.0, 4.0))
    monkeypatch.setattr(hardware, "detect_cuda", lambda index=0: None)
    monkeypatch.setattr(hardware, "detect_apple", lambda: None)
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    assert "bf16 probe: bf16 runs 2.50x float32's speed here; auto picks bfloat16" in out
    assert "  bf16  torch on cpu, bfloat16, kernel dense" in out
    assert doctor.main(["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["hardware"]["bf16_speedup"] == 2.5 and info["auto"]["bf16"]["dtype"] == "bfloat16"
