"""The prepared GPU script (benchmarks/gpu_check.sh → benchmarks/flagship.py) runs end to end on a CPU with
--dry-run, says "not run" wherever a GPU is needed, and resumes after a cut."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLAGSHIP = ROOT / "benchmarks" / "flagship.py"
LABELS = ("(d) tests marked cuda", "quantized kernels, one layer", "(a) Clef 27B int4, 24 GiB cap",
          "(c) Clef-flash BF16, whole card", "(c) Clef-flash int4, whole card",
          "(c) gated delta net, reference PyTorch path", "(b) Clef 27B int8, 2 × 24 GiB simulated")
RELEASES = ("clef-int4", "clef-int8", "flash-bf16", "flash-int4")


def _flagship(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(FLAGSHIP), *args], capture_output=True, text=True, timeout=300)


def test_a_spent_budget_runs_nothing_and_says_so(tmp_path: Path) -> None:
    done = _flagship("--out", str(tmp_path / "out"), "--dry-run", "--budget-s", "0")
    assert done.returncode == 0, done.stderr
    table = (tmp_path / "out" / "flagship.md").read_text()
    for label in LABELS:
        assert f"| {label} | not run (time budget spent; rerun to resume) |" in table
    assert "(c) gated delta net, flash-linear-attention | not run (" in table
    assert not (tmp_path / "out" / "results").exists()


def test_only_names_the_steps_left_out(tmp_path: Path) -> None:
    done = _flagship("--out", str(tmp_path / "out"), "--dry-run", "--only", "a", "--budget-s", "0")
    assert done.returncode == 0, done.stderr
    table = (tmp_path / "out" / "flagship.md").read_text()
    assert "| (b) Clef 27B int8, 2 × 24 GiB simulated | not run (not asked for (--only)) |" in table


@pytest.mark.slow
def test_the_dry_run_runs_every_step_on_a_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = (tmp_path / "out" / "flagship.md").read_text()
    print(table)
    rows = [line for line in table.splitlines() if line.startswith("| (") or line.startswith("| kernels")]
    assert not [r for r in rows if "failed" in r or "no result" in r]
    for context in (320, 448):  # the dry run's contexts (flagship.DRY)
        assert f"| (a) Clef 27B int4, 24 GiB cap, {context:,} tokens | yes | not run (no CUDA) (plan " in table
    assert sum("| (c) Clef-flash bf16, " in r and "| not run (no CUDA) |" in r for r in rows) == 3  # H200 share
    assert sum(r.startswith("| (b) Clef 27B int8 stage ") and "| not run (no CUDA) |" in r for r in rows) == 2
    assert "| (d) tests marked cuda | not run (no CUDA: every test skipped) |" in table
    assert "(c) gated delta net, reference path" in table and "| kernels nf4: " in table
    # header + 6 kernels (bf16, int4, int8, int8 through torch._int_mm, fp8, nf4) × 2 shapes
    assert (tmp_path / "out" / "kernels.md").read_text().count("\n") == 2 + 6 * 2
    assert not any((tmp_path / "work" / name).exists() for name in RELEASES)  # deleted when done
    # a second run finds every result and runs no step again
    again = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0 and "== " not in again.stdout
    assert (tmp_path / "out" / "flagship.md").read_text() == table
