"""``clef-local export-gguf`` end to end on tiny releases: the GGUF release layout (the release's small files byte for
byte, no safetensors backbone, gguf/gguf_config.json read back from the file, a manifest that verifies), atomic
writes (a failure or a refusal leaves nothing at --out), the disk check, and validation through the llama.cpp backend
(a faithful GGUF passes, a converter bug is refused at the first look with its report kept)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clef_local.cli import main as cli_main
from clef_local.export.gguf import export as gguf_export
from clef_local.export.gguf import validate as gguf_validate
from clef_local.export.staging import ExportError
from clef_local.formats.gguf_release import GGUF_CONFIG_PATH, GGUF_PATH, VISION_PATH, check_gguf
from clef_local.formats.manifest import MANIFEST, list_files, read_manifest, verify
from clef_local.formats.release import read_release
from clef_local.formats.safetensors import read_arrays


def _nothing_at(out: Path) -> None:
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]  # no staging left


def _check_layout(source: Path, out: Path) -> dict:
    names = set(list_files(out))
    copied = {n for n in list_files(source) if not n.startswith("model") and n != MANIFEST}
    vision = read_release(source).has_vision
    assert names == copied | {GGUF_PATH, GGUF_CONFIG_PATH} | ({VISION_PATH} if vision else set())
    for name in copied:  # byte for byte: the joint head and its config among them
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    if vision:  # the vision tower stays on torch: its tensors as stored
        kept = read_arrays(out / VISION_PATH)
        stored = read_arrays(source / "model.safetensors", lambda n: n.startswith("model.visual."))
        assert set(kept) == set(stored) and all(np.array_equal(kept[n], stored[n]) for n in stored)
    assert verify(out) == []
    config = json.loads((out / GGUF_CONFIG_PATH).read_text())
    assert read_manifest(out)["gguf"]["tensor_types"] == config["tensor_types"]
    release = read_release(out)
    assert release.is_gguf
    check_gguf(release.gguf, release, hashed=True)
    return config


def test_cli_q8_0_end_to_end(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'clef-local[gguf]')")
    from clef_local.export.gguf.quantize import tensor_types

    out = tmp_path / "llama-q8"
    assert cli_main(["export-gguf", "--model", str(tiny_llama), "--out", str(out), "--type", "Q8_0",
                     "--no-validate", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"Q8_0 → {out}" in printed and "validation skipped: --no-validate" in printed
    config = _check_layout(tiny_llama, out)
    held = tensor_types(out / GGUF_PATH)
    assert config["tensor_types"] == held["counts"] and config["file_type"] == "MOSTLY_Q8_0"
    assert config["lm_head_tensor"] == "token_embd.weight"  # tied: llama.cpp's output rows are token_embd's
    assert config["output_tensor_type"] == held["tensors"]["token_embd.weight"] == "BF16"
    assert config["writer"]["llama_cpp_python"] and config["source"]["digest"]
    assert config["validation"] == {"skipped": "--no-validate"}
    assert not (out / "gguf" / gguf_export.FLOAT_STAGE).exists()


def test_float_export_and_force(tiny_qwen: Path, tmp_path: Path) -> None:
    out = tmp_path / "qwen-bf16"
    summary = gguf_export.export_gguf(tiny_qwen, out, "BF16", validate=False)
    config = _check_layout(tiny_qwen, out)
    assert config["architecture"] == "qwen35" and config["writer"]["llama_cpp_python"] is None
    assert config["vision"]["file"] == VISION_PATH and config["vision"]["tensors"] > 0
    assert config["output_tensor_type"] == "BF16" and set(config["tensor_types"]) == {"BF16", "F32"}
    assert summary["gguf_bytes"] == (out / GGUF_PATH).stat().st_size
    with pytest.raises(ExportError, match="exists; pass --force"):
        gguf_export.export_gguf(tiny_qwen, out, "F16", validate=False)
    gguf_export.export_gguf(tiny_qwen, out, "F16", validate=False, force=True)
    assert json.loads((out / GGUF_CONFIG_PATH).read_text())["type"] == "F16"
    with pytest.raises(ExportError, match="already a GGUF release"):
        gguf_export.export_gguf(out, tmp_path / "again", "F32", validate=False)
    with pytest.raises(ExportError, match="--imatrix weighs a quantizer's rounding; --type F16 is not quantized"):
        gguf_export.export_gguf(tiny_qwen, tmp_path / "imatrix", "F16", validate=False, imatrix=True)
    _nothing_at(tmp_path / "imatrix")


def test_a_gguf_that_computes_its_reference_passes_validation(tiny_llama: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """F32 on llama.cpp computes what the reference computes (the parity tests): the export's validation, run through
    the llamacpp backend, passes it. Held to int4's limits here so that 64 probes can decide (int8's 1% needs ~370
    questions, F32's own limits)."""
    monkeypatch.setitem(gguf_validate.LIMITS_OF, "F32", "int4")
    out = tmp_path / "f32"
    assert cli_main(["export-gguf", "--model", str(tiny_llama), "--out", str(out), "--type", "F32",
                     "--validation-requests", "64", "--no-progress"]) == 0
    assert "validation: pass after" in capsys.readouterr().out
    record = json.loads((out / "validation.json").read_text())
    assert record["verdict"] == "pass" and record["metrics"]["mean_kl"] < 1e-3
    assert record["runs"]["variant"]["requests"] == record["requests"]  # the GGUF ran every probe the verdict used
    assert json.loads((out / GGUF_CONFIG_PATH).read_text())["validation"]["verdict"] == "pass"
    assert verify(out) == []  # validation.json is in the manifest


@pytest.mark.slow  # the demo model: a tiny random release barely reacts to its backbone (this bug moves its KL 20x,
# to 4e-5, with one flip in 144 questions); the demo's trained head does
def test_a_converter_bug_is_refused_at_the_first_look_and_its_report_kept(demo_release: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The MLP's gate and up projections written under each other's names (same shapes): the model loads and runs,
    its decisions do not. Refused at the first look, nothing at --out, the measurement kept beside it."""
    from clef_local.export.gguf import llama

    monkeypatch.setitem(llama.LAYER_NAMES, "mlp.gate_proj.weight", "ffn_up.weight")
    monkeypatch.setitem(llama.LAYER_NAMES, "mlp.up_proj.weight", "ffn_gate.weight")
    monkeypatch.setitem(gguf_validate.LIMITS_OF, "F32", "int4")  # as above: 64 probes may decide
    out = tmp_path / "broken"
    assert cli_main(["export-gguf", "--model", str(demo_release), "--out", str(out), "--type", "F32",
                     "--validation-requests", "64", "--no-progress"]) == 1
    error = capsys.readouterr().err
    assert "the F32 GGUF (held to int4's limits) fails validation:" in error and "flip_rate 0." in error
    assert f"nothing was written to {out}" in error
    _nothing_at(out)
    report = out.with_name(out.name + ".validation.json")
    assert f"report: {report}" in error
    record = json.loads(report.read_text())
    assert record["verdict"] == "fail" and record["requests"] == 16  # the first look decided


def test_too_few_probes_to_ever_pass_are_refused_before_any_work(tiny_llama: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "few"
    assert cli_main(["export-gguf", "--model", str(tiny_llama), "--out", str(out), "--type", "Q8_0",
                     "--validation-requests", "16"]) == 2
    assert "cannot show a flip rate ≤ 0.01" in capsys.readouterr().err
    _nothing_at(out)


def test_a_failure_leaves_nothing(tiny_qwen: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from clef_local.export.gguf import convert

    out = tmp_path / "failed"

    def broken(*args: object, **kwargs: object) -> None:
        raise ExportError("the disk went away")

    monkeypatch.setattr(convert, "write_gguf", broken)
    with pytest.raises(ExportError, match="the disk went away"):
        gguf_export.export_gguf(tiny_qwen, out, "F32", validate=False)
    _nothing_at(out)


def test_disk_space_checked_first(tiny_qwen: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(gguf_export.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1000))
    out = tmp_path / "full"
    with pytest.raises(ExportError, match=r"not enough disk space for .*full: the Q4_K_M export needs about"):
        gguf_export.export_gguf(tiny_qwen, out, "Q4_K_M", validate=False)
    _nothing_at(out)
    need = gguf_export.estimate_bytes(read_release(tiny_qwen), "Q4_K_M")
    assert need["float"] > need["final"] > 0 and need["total"] > need["float"] + need["final"]
