"""Hardware detection and named devices (clef_local.planning.hardware)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clef_local.planning.hardware import cpu_bf16, detect, host_memory, named_device, resolve_device
from clef_local.units import GiB, MiB


def test_detect_here_is_a_cpu_with_cores_and_memory() -> None:
    hw = detect("cpu")
    assert hw.kind == "cpu" and hw.device == "cpu"
    assert hw.cores >= 1
    assert 0 < hw.free_bytes <= hw.total_bytes == hw.host_total_bytes
    assert hw.shares_host_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="compares with Linux's /proc/meminfo")
def test_host_memory_is_the_kernels_available_memory_not_the_total() -> None:
    """psutil's numbers: here MemTotal and MemAvailable (within what other processes change between the reads); on
    macOS the free and reclaimable pages, where the sysconf fallback used to report free = total."""
    from pathlib import Path

    total, available = host_memory()
    meminfo = {k: int(v.split()[0]) * 1024 for k, _, v in
               (line.partition(":") for line in Path("/proc/meminfo").read_text().splitlines())}
    assert total == meminfo["MemTotal"]
    assert abs(available - meminfo["MemAvailable"]) < 256 * MiB
    assert 0 < available < total


@pytest.mark.parametrize(("flags", "expected"), [
    (("avx2", "avx512_bf16"), True),
    (("avx512_bf16", "amx_bf16", "amx_tile"), True),
    (("asimd", "bf16"), True),
    (("avx2",), False),
])
def test_cpu_bf16_support_comes_from_the_flags_and_its_speed_does_not(flags: tuple[str, ...], expected: bool) -> None:
    assert cpu_bf16(flags) is expected  # whether it is *faster* is measured: tests/test_dtype_probe.py


def test_detect_without_torch_or_mlx_does_not_fail() -> None:
    code = ("import sys; sys.modules['torch'] = None; sys.modules['mlx'] = None\n"
            "from clef_local.planning.hardware import detect\n"
            "hw = detect()\n"
            "assert hw.kind == 'cpu', hw\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "print(hw.summary())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("cpu cpu:")


def test_asking_for_missing_cuda_names_the_fix() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"no CUDA GPU visible.*--device cpu"):
        detect("cuda")


def test_named_cards() -> None:
    card = named_device("rtx4090")
    assert (card.kind, card.compute_capability, card.fp8, card.bf16) == ("cuda", (8, 9), True, True)
    assert card.total_bytes == card.free_bytes == 24564 * MiB
    a100 = named_device("A100-80G")
    assert a100.compute_capability == (8, 0) and not a100.fp8 and a100.bf16
    assert named_device("h200").total_bytes == 143771 * MiB
    generic = named_device("24GiB")
    assert generic.kind == "cuda" and generic.total_bytes == 24 * GiB and generic.compute_capability is None
    assert named_device("24GB").total_bytes == 24 * 10**9  # one size parser: GB is decimal everywhere
    with pytest.raises(ValueError, match="cannot read the device size '24g'"):
        named_device("24g")


def test_named_macs_use_metals_default_working_set() -> None:
    mac = named_device("mac-36")
    assert mac.kind == "apple" and mac.unified_memory and mac.fast_bf16
    assert mac.free_bytes == int(36 * GiB * 0.75) and mac.host_total_bytes == 36 * GiB
    assert named_device("mac-16").free_bytes == int(16 * GiB * 2 / 3)


def test_named_cpu_and_unknown_names() -> None:
    box = named_device("cpu-8")
    assert box.kind == "cpu" and box.free_bytes == 8 * GiB and not box.fast_bf16
    with pytest.raises(ValueError, match=r"unknown device 'tpu-v5'.*rtx4090.*mac-NN"):
        named_device("tpu-v5")
    assert resolve_device("cpu").kind == "cpu"
