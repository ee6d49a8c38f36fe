"""The command line as a user runs it: decide (file, stdin, example, default model) and inspect."""

from __future__ import annotations

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
