"""Packaging: the wheel holds the mapped subpackages and the packaged data; CI runs README's test command."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The datasets and config shapes a clone or an installed wheel reads instead of anything beside the checkout.
PACKAGED_DATA = (
    "clef_local/data/README.md", "clef_local/data/banking77/train.csv", "clef_local/data/banking77/test.csv",
    "clef_local/data/banking77/categories.json", "clef_local/data/banking77/LICENSE",
    "clef_local/data/nlupp/ontology.json", "clef_local/data/nlupp/LICENSE",
    "clef_local/planning/configs/README.md", "clef_local/planning/configs/clef.config.json",
    "clef_local/planning/configs/clef.joint_head_config.json", "clef_local/planning/configs/clef-flash.config.json",
    "clef_local/planning/configs/clef-flash.joint_head_config.json",
)


def test_wheel_contains_mapped_subpackages(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(ROOT)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("clef_local-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("clef_local/export/__init__.py", "clef_local/quant/__init__.py", "clef_local/app/__init__.py",
                   "clef_local/runtime/head.py", "clef_local/backends/torch_backend.py",
                   "clef_local/demo/examples/triage.json", *PACKAGED_DATA):
        assert module in names, f"{module} missing from {wheel.name}"
    folds = {n for n in names if n.startswith("clef_local/data/nlupp/banking/fold") and n.endswith(".json")}
    assert len(folds) == 20, sorted(folds)
    # Nothing generic lands at the top of site-packages.
    assert not any(n.startswith(("app/", "quant/", "export/", "tests/", "benchmarks/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "clef-local = clef_local.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_subpackage_init_says_where_it_installs():
    for folder in ("export", "quant", "app"):
        first = (ROOT / folder / "__init__.py").read_text().splitlines()[0]
        assert f"clef_local.{folder}" in first


def test_ci_runs_the_readme_test_command():
    command = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line)
    assert command in (ROOT / "README.md").read_text(), "README's test command and .ci/run differ"
