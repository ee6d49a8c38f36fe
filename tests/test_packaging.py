"""Packaging: the wheel holds the mapped subpackages and the packaged data; CI runs README's test command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (built,) = out.glob("clef_local-*.whl")
    return built


def test_every_package_directory_is_a_package():
    """Setuptools finds packages by their ``__init__.py``: a folder of modules without one would not be installed."""
    for folder in (ROOT / "clef_local").rglob("*"):
        if folder.is_dir() and any(folder.glob("*.py")) and "__pycache__" not in folder.parts:
            assert (folder / "__init__.py").is_file(), f"{folder} has modules but no __init__.py"


def test_wheel_contains_every_subpackage(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("clef_local/export/__init__.py", "clef_local/quant/__init__.py", "clef_local/app/__init__.py",
                   "clef_local/heads/torch_head.py", "clef_local/backends/torch_backend.py",
                   "clef_local/demo/examples/triage.json", *PACKAGED_DATA):
        assert module in names, f"{module} missing from {wheel.name}"
    folds = {n for n in names if n.startswith("clef_local/data/nlupp/banking/fold") and n.endswith(".json")}
    assert len(folds) == 20, sorted(folds)
    # Nothing generic lands at the top of site-packages.
    assert not any(n.startswith(("app/", "quant/", "export/", "tests/", "benchmarks/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "clef-local = clef_local.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_ci_runs_the_readme_test_command():
    command = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line)
    assert command in (ROOT / "README.md").read_text(), "README's test command and .ci/run differ"


def test_the_wheel_works_from_a_fresh_venv_outside_the_repository(wheel: Path, tiny_qwen: Path, tmp_path: Path):
    """A non-editable install: the wheel alone in a new venv (its dependencies reached through a .pth line to this
    environment's site-packages, so nothing is downloaded), run from outside the checkout: ``serve --help``,
    ``ui --help`` and ``decide --example triage`` on a tiny release."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                                "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    # the dependencies, not clef_local: this environment's editable finder lives in a .pth that is not read here
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CLEF_LOCAL_DATASETS")}
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(python), "-m", "clef_local.cli", *args], capture_output=True, text=True,
                              cwd=outside, env=env, timeout=300)

    where = subprocess.run([str(python), "-c", "import clef_local; print(clef_local.__file__)"], capture_output=True,
                           text=True, cwd=outside, env=env, check=True).stdout.strip()
    assert Path(where).is_relative_to(site), where  # the wheel's copy, not the checkout
    serve, ui = run("serve", "--help"), run("ui", "--help")
    assert serve.returncode == 0 and "--max-batch" in serve.stdout, serve.stderr
    assert ui.returncode == 0 and "--compare" in ui.stdout, ui.stderr
    decided = run("decide", "--example", "triage", "--model", str(tiny_qwen))
    assert decided.returncode == 0, decided.stderr[-3000:]
    example = json.loads((ROOT / "clef_local" / "demo" / "examples" / "triage.json").read_text())
    answers = json.loads(decided.stdout)["answers"]
    assert set(answers) == set(example["questions"])
    assert answers["category"]["choice"] in example["questions"]["category"]["criteria"]
