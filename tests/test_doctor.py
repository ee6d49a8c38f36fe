"""clef-local doctor: hardware, backends and the extra that adds each."""

from __future__ import annotations

import importlib.util
import json

import pytest

from clef_local.planning import doctor


def test_doctor_json_lists_hardware_backends_and_extras(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main(["--json", "--no-probe"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["hardware"]["kind"] in ("cpu", "cuda", "apple")
    components = {c["name"]: c for c in info["components"]}
    assert components["torch"]["installed"] == (importlib.util.find_spec("torch") is not None)
    assert components["bitsandbytes"]["extra"] == "cuda"
    assert components["mlx"]["extra"] == "mlx" and components["onnxruntime"]["extra"] == "onnx"
    assert components["gradio"]["extra"] == "ui" and components["fastapi"]["extra"] == "serve"
    assert components["matplotlib"]["install"] == "pip install 'clef-local[report]'"
    assert info["backends"]["torch"]["available"]
    assert set(info["auto"]) == {"bf16", "int8", "fp8", "int4", "nf4"}
    if info["hardware"]["kind"] == "cpu" and not info["hardware"]["fast_bf16"]:
        assert info["auto"]["bf16"]["dtype"] == "float32"


def test_doctor_text_names_missing_components_with_their_install(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda name: None if name == "gradio" else real(name))
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    assert "gradio           not installed: pip install 'clef-local[ui]'" in out
    assert "hardware" in out and "backends" in out and "auto would run" in out
