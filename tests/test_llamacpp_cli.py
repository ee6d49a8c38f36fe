"""The command line on a GGUF release: ``clef-local decide --backend llamacpp`` end to end, ``plan`` with
llama.cpp's terms, ``doctor`` with llama.cpp's build, and the one-line refusals. Skipped without llama-cpp-python.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'clef-local[gguf]')")

from clef_local.cli import main
from clef_local.export.gguf.export import export_gguf

REQUEST = {"model": "clef-test", "state": {"ticket": "card declined twice at the airport", "vip": True},
           "questions": {"kind": {"type": "choice", "criteria": {"card": "A card problem", "refund": None,
                                                                 "other": "anything else"}},
                         "urgent": {"type": "noul", "instructions": "Is it urgent?"},
                         "tone": {"type": "score", "criteria": ["calm", "annoyed", "angry"]}}}


@pytest.fixture(scope="module")
def gguf_qwen(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llamacpp-cli") / "qwen-gguf"
    export_gguf(tiny_qwen, out, "F32", validate=False)
    return out


def test_decide_on_a_gguf_release(gguf_qwen: Path, qwen_model, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    file = tmp_path / "request.json"
    file.write_text(json.dumps(REQUEST))
    argv = ["decide", "--model", str(gguf_qwen), "--backend", "llamacpp", "--dtype", "float32", "--max-length",
            "4096", "--full-precision", "--request", str(file)]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = qwen_model.decide(REQUEST)  # torch float32 on the source release
    assert printed["usage"] == expected["usage"]
    for qid, answer in expected["answers"].items():
        got = printed["answers"][qid]
        if answer["type"] == "noul":
            assert got["noul"] == pytest.approx(answer["noul"], abs=1e-5)
        else:
            assert got["probabilities"] == pytest.approx(answer["probabilities"], abs=1e-5)


def test_refusals_are_one_line(gguf_qwen: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    file = tmp_path / "request.json"
    file.write_text(json.dumps(REQUEST))
    assert main(["decide", "--model", str(gguf_qwen), "--backend", "torch", "--request", str(file)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "only --backend llamacpp runs it" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "joint_head_config.json", "joint_head.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        (broken / name).write_bytes((gguf_qwen / name).read_bytes())
    (broken / "gguf").mkdir()
    (broken / "gguf" / "model.gguf").write_bytes(b"GGML" + bytes(60))
    assert main(["decide", "--model", str(broken), "--request", str(file)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not a GGUF file" in err


def test_plan_and_doctor(gguf_qwen: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--model", str(gguf_qwen), "--device", "cpu", "--context", "8192", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    (only,) = plan["plans"]
    assert only["backend"] == "llamacpp" and only["context"] == 8192 and only["fits"]
    assert only["tensor_types"] == {"F32": plan["gguf"]["type_counts"]["F32"]}
    assert only["kv_cache"] == 8192 * 1 * 2 * 2 * 16 * 2  # one attention layer, 2 KV heads of 16, F16
    assert main(["plan", "--model", str(gguf_qwen), "--device", "cpu", "--explain"]) == 0
    text = capsys.readouterr().out
    assert "on llama.cpp" in text and "KV cache (float16)" in text and "recurrent state" in text
    assert main(["doctor", "--json", "--no-probe"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["backends"]["llamacpp"]["available"]
    assert set(info["llama_cpp"]["builds"]) == {"Metal", "CUDA", "Vulkan", "ROCm"}
    assert 'CMAKE_ARGS="-DGGML_CUDA=on"' in info["llama_cpp"]["builds"]["CUDA"]
