"""``clef-local export-gguf`` end to end on tiny releases: the GGUF release layout (the release's small files byte for
byte, no safetensors backbone, gguf/gguf_config.json read back from the file, a manifest that verifies), atomic
writes (a failure or a refusal leaves nothing at --out), the disk check, and validation refused rather than faked
until the llama.cpp backend is merged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clef_local.cli import main as cli_main
from clef_local.export.gguf import export as gguf_export
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


def test_validation_is_refused_not_faked(tiny_qwen: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "validated"
    assert cli_main(["export-gguf", "--model", str(tiny_qwen), "--out", str(out), "--type", "F32"]) == 2
    assert "validation cannot run: the llama.cpp backend" in capsys.readouterr().err
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
