"""An honest core install: the wheel, without extras, in a fresh venv outside the checkout, runs every core command
of README's table (before: ``calibrate`` ended with No module named 'scipy', an image request with No module named
'PIL', and CI could not see it because the dev extra brought both).

The venv is clean (no system site-packages); torch goes in first and pinned, as scripts/test.sh and README install
it, then the wheel with constraints.txt, so pip resolves the same versions CI tests. It needs the package index the
machine's pip is configured with (or pip's cache); everything is installed once for the module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
from media_gen import image

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# README's commands that need an extra (its extras table): not run here.
NEEDS_AN_EXTRA = {"serve", "mcp", "ui", "export-onnx", "export-gguf", "report"}
# import names of every extra's packages: none may be in the core install, or the test would prove nothing
EXTRA_MODULES = ("fastapi", "uvicorn", "mcp", "gradio", "matplotlib", "onnxruntime", "onnx", "mlx", "pyarrow", "ray",
                 "bitsandbytes", "torchvision", "llama_cpp")


class Core(NamedTuple):
    run: Callable[..., subprocess.CompletedProcess]  # run(*args): clef-local ARGS from the core install, in work
    work: Path  # outside the checkout
    python: Path  # the venv's


def pip(python: Path, *args: str) -> None:
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), *args],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"pip install {' '.join(args)} failed:\n{done.stderr[-4000:]}"


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Core:
    """The core install, built once for the module."""
    base = tmp_path_factory.mktemp("core_install")
    assert not base.is_relative_to(ROOT)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(base / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (base / "dist").glob("clef_local-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(base / "venv")], check=True, timeout=300)
    python = base / "venv" / "bin" / "python"
    pip(python, "torch==2.13.0")  # first and pinned: a bare requirement would pull a CUDA build
    pip(python, str(wheel))  # no extras
    work = base / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CLEF_LOCAL_DATASETS", "VIRTUAL_ENV")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"

    def run(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([str(python.parent / "clef-local"), *args], capture_output=True, text=True, cwd=work,
                              env=env, timeout=300)
        assert done.returncode == 0, f"clef-local {' '.join(args)}: exit {done.returncode}\n{done.stderr[-3000:]}"
        return done

    return Core(run, work, python)


def readme_commands() -> set[str]:
    """The commands of README's command table (``clef-local data convert`` counts as ``data``)."""
    return set(re.findall(r"^\| `clef-local ([a-z-]+)", (ROOT / "README.md").read_text(), flags=re.MULTILINE))


# the commands the tests below run; the table's others need an extra
COVERED = {"decide", "inspect", "quantize", "verify", "doctor", "plan", "batch", "data", "eval", "drift", "probe",
           "calibrate", "train-head"}


def test_every_readme_command_is_run_or_needs_an_extra():
    assert readme_commands() == COVERED | NEEDS_AN_EXTRA


def test_the_install_is_the_wheel_without_any_extra(core: Core):
    _, work, python = core
    probe = ("import importlib.util, json, clef_local; print(json.dumps({'file': clef_local.__file__, 'found': "
             f"[m for m in {EXTRA_MODULES!r} if importlib.util.find_spec(m)]}}))")
    seen = json.loads(subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=work,
                                     check=True).stdout)
    assert Path(seen["file"]).is_relative_to(python.parent.parent), seen  # the wheel's copy, not the checkout
    assert seen["found"] == []
    assert importlib.util.find_spec("fastapi") is not None  # this checkout's venv has them: the check can fail


def test_decide_with_an_image_answers_as_the_library(core: Core, tiny_vision: Path, vision_model):
    from media_gen import data_uri

    from clef_local.runtime.answers import round_floats

    run, work, _ = core
    photo = image(120, 90, seed=21)
    (work / "a.png").write_bytes(photo)
    questions = {"ok": {"type": "noul", "instructions": "Is <image 1> fine?"},
                 "kind": {"type": "choice", "criteria": {"a": "a photo", "b": None}}}
    (work / "r.json").write_text(json.dumps({"model": "m", "state": "a picture", "questions": questions}))
    printed = json.loads(run("decide", "--model", str(tiny_vision), "--dtype", "float32", "--request", "r.json",
                             "--image", "a.png").stdout)
    expected = vision_model.decide({"model": "m", "state": "a picture", "questions": questions,
                                    "images": [data_uri(photo)]})
    assert printed == round_floats(expected, 4)
    example = json.loads(run("decide", "--example", "triage", "--model", str(tiny_vision)).stdout)
    triage = json.loads((ROOT / "clef_local" / "demo" / "examples" / "triage.json").read_text())
    assert set(example["answers"]) == set(triage["questions"])


def test_inspect_plan_doctor(core: Core, tiny_vision: Path):
    run, _, _ = core
    inspected = json.loads(run("inspect", "--model", str(tiny_vision)).stdout)
    assert inspected["vision_tower"] is True and inspected["media"]["images"] == "accepted"
    assert inspected["loader"]["backend"] == "torch"
    plan = run("plan", "--config", "clef", "--device", "rtx4090").stdout
    assert re.search(r"^int4 .* fits", plan, flags=re.MULTILINE), plan
    components = {c["name"]: c for c in json.loads(run("doctor", "--json").stdout)["components"]}
    assert components["torch"]["installed"] and not components["fastapi"]["installed"]
    assert components["fastapi"]["install"] == "pip install 'clef-local[serve]'"  # the core install knows its extras


@pytest.fixture(scope="module")
def labelled(core: Core) -> Path:
    """Four BANKING77 requests from ``data convert``, as calibrate / eval / drift / probe read them."""
    run, work, _ = core
    assert "wrote 4 requests" in run("data", "convert", "--dataset", "banking77", "--split", "test", "--limit", "4",
                                     "--k", "4", "--out", "b77.jsonl").stdout
    return work / "b77.jsonl"


def test_calibrate_eval_probe(core: Core, tiny_vision: Path, labelled: Path, tmp_path: Path):
    import shutil

    run, work, _ = core
    variant = shutil.copytree(tiny_vision, tmp_path / "variant")
    fitted = run("calibrate", "--model", str(variant), "--data", str(labelled))
    assert re.search(r"^choice\s+T=[0-9.]+", fitted.stdout, flags=re.MULTILINE), fitted.stdout
    assert json.loads((variant / "config.json").read_text())["clef_local_calibration"]["temperatures"]["choice"] > 0
    run("eval", "--model", str(tiny_vision), "--data", str(labelled), "--json", "eval.json")
    assert json.loads((work / "eval.json").read_text())["requests"] == 4
    run("probe", "--model", str(tiny_vision), "--data", str(labelled), "--limit", "2", "--json", "probe.json")
    (probed,) = json.loads((work / "probe.json").read_text())["probes"]
    assert probed["requests"] == 2 and "option_order" in probed["checks"]


def test_quantize_verify_drift(core: Core, tiny_vision: Path, labelled: Path):
    run, work, _ = core
    assert "int8 →" in run("quantize", "--model", str(tiny_vision), "--format", "int8", "--out", "int8",
                           "--no-validate").stdout
    assert run("verify", "int8").stdout.startswith("ok: ")
    run("drift", "--reference", str(tiny_vision), "--candidate", "int8", "--data", str(labelled), "--json", "d.json")
    (summary,) = [d["summary"] for d in json.loads((work / "d.json").read_text())["drift"]]
    assert summary["questions"] == 4 and 0 <= summary["kl_mean"] < 1e-3


def test_batch_and_train_head(core: Core, tiny_vision: Path, labelled: Path):
    run, work, _ = core
    rows = [json.loads(line) for line in labelled.read_text().splitlines()]
    (work / "rows.jsonl").write_text("".join(json.dumps({"state": r["state"]}) + "\n" for r in rows[:2]))
    (work / "s.json").write_text(json.dumps({"intent": {"type": "choice", "criteria": {"lost": None, "other": None}}}))
    assert "2 answered" in run("batch", "--model", str(tiny_vision), "--in", "rows.jsonl", "--schema", "s.json",
                               "--out", "labels.jsonl", "--no-progress").stdout
    answers = [json.loads(line)["answers"]["intent"] for line in (work / "labels.jsonl").read_text().splitlines()]
    assert [sorted(a["probabilities"]) for a in answers] == [["lost", "other"]] * 2
    # train-head reads {"request", "labels"} lines
    (work / "train.jsonl").write_text("".join(json.dumps({"request": {k: v for k, v in r.items() if k != "labels"},
                                                          "labels": r["labels"]}) + "\n" for r in rows))
    log = json.loads(run("train-head", "--backbone", str(tiny_vision), "--out", "head", "--data", "train.jsonl",
                         "--epochs", "1", "--width", "64", "--heads", "1").stdout)
    assert log["epoch"] == 1 and (work / "head" / "joint_head.safetensors").is_file()
