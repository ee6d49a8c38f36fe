"""The GGUF release layout (clef_local.formats.gguf_release): read_release opens it without safetensors weights, and
check_gguf refuses a truncated GGUF, a GGUF of another architecture and a head for another hidden size, each in one
line naming the file, before llama.cpp reads anything (llama_cpp is made unimportable while they run)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from clef_local.errors import ReleaseError
from clef_local.export.gguf.convert import write_gguf
from clef_local.export.gguf.export import export_gguf
from clef_local.formats.gguf_release import GGUF_PATH, check_gguf, gguf_path, read_gguf_config
from clef_local.formats.manifest import MANIFEST, write_manifest
from clef_local.formats.release import read_release


@pytest.fixture(scope="module")
def gguf_release(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf-release") / "qwen-f32"
    export_gguf(tiny_qwen, out, "F32", validate=False)
    return out


@pytest.fixture
def copy(gguf_release: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy to damage; llama.cpp cannot be imported while the test runs (the checks must not need it)."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    target = tmp_path / "release"
    shutil.copytree(gguf_release, target)
    return target


def _one_line(exc: pytest.ExceptionInfo[ReleaseError]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_read_release_opens_a_gguf_release(gguf_release: Path, tiny_qwen: Path) -> None:
    release = read_release(gguf_release)
    assert release.is_gguf and release.gguf == gguf_path(gguf_release)
    assert release.weight_files == (release.gguf,)
    assert not list(gguf_release.glob("model*.safetensors*"))  # no backbone weights beside the GGUF
    assert (gguf_release / "joint_head.safetensors").read_bytes() == (tiny_qwen / "joint_head.safetensors").read_bytes()
    assert release.hidden_size == release.head_config.hidden_size == 64
    assert check_gguf(release.gguf, release, hashed=True) == {
        "architecture": "qwen35", "tensors": 56, "bytes": release.gguf.stat().st_size}
    config = read_gguf_config(gguf_release)
    assert config is not None and config["type"] == "F32" and config["architecture"] == "qwen35"
    assert config["tensor_types"] == {"F32": 56}
    source = read_release(tiny_qwen)
    assert not source.is_gguf and source.gguf is None  # a safetensors release is unchanged


def test_truncated_gguf(copy: Path) -> None:
    path = copy / GGUF_PATH
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * 0.7)])
    with pytest.raises(ReleaseError) as exc:  # the manifest's size, on every load
        read_release(copy)
    assert f"{path}: {int(len(data) * 0.7)} bytes, {MANIFEST} records {len(data)}" in _one_line(exc)
    (copy / MANIFEST).unlink()  # no manifest: the tensor table says where the data must end
    release = read_release(copy)
    with pytest.raises(ReleaseError, match=r"ends at byte \d+, the file has \d+ \(truncated\)") as exc:
        check_gguf(path, release)
    assert _one_line(exc).startswith(f"{path}: tensor ")
    path.write_bytes(data[:1000])  # cut inside the metadata
    with pytest.raises(ReleaseError, match=r"not a complete GGUF file \(.+ past the end\); the file is truncated"
                       ) as exc:
        check_gguf(path, release)
    assert _one_line(exc).startswith(f"{path}: ")


def test_gguf_of_another_architecture(copy: Path, tiny_llama: Path) -> None:
    path = copy / GGUF_PATH
    write_gguf(read_release(tiny_llama), path, "F32")
    write_manifest(copy)  # listed with its size and hash: the architecture is what refuses it
    release = read_release(copy)
    with pytest.raises(ReleaseError) as exc:
        check_gguf(path, release)
    assert _one_line(exc) == (f"{path}: general.architecture is 'llama', but the release at {copy} has a qwen3_5 "
                              f"backbone ('qwen35'); use the GGUF exported from this release")


def test_head_for_another_hidden_size(copy: Path) -> None:
    path = copy / GGUF_PATH
    head_config = json.loads((copy / "joint_head_config.json").read_text())
    release = read_release(copy)
    narrow = dataclasses.replace(release, head_config=dataclasses.replace(release.head_config, hidden_size=32))
    with pytest.raises(ReleaseError) as exc:  # check_gguf's own check
        check_gguf(path, narrow)
    assert _one_line(exc) == (f"{copy / 'joint_head_config.json'}: the head reads hidden_size 32, model.gguf "
                              f"computes 64; use the head of the release the GGUF was exported from")
    head_config["hidden_size"] = 32  # and on disk: the release itself is refused first
    (copy / "joint_head_config.json").write_text(json.dumps(head_config))
    write_manifest(copy)
    with pytest.raises(ReleaseError, match="hidden_size 32 does not match the backbone's hidden_size 64") as exc:
        read_release(copy)
    _one_line(exc)


def test_gguf_for_another_width(copy: Path) -> None:
    import gguf

    path = copy / GGUF_PATH
    writer = gguf.GGUFWriter(str(path), "qwen35")
    writer.add_embedding_length(32)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (copy / MANIFEST).unlink()
    with pytest.raises(ReleaseError) as exc:
        check_gguf(path, read_release(copy))
    assert _one_line(exc).startswith(f"{path}: qwen35.embedding_length is 32, the release's config.json has "
                                     f"hidden_size 64")


def test_not_a_gguf_and_a_changed_one(copy: Path) -> None:
    path = copy / GGUF_PATH
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size: only the hash (at export, or verify) sees it
    path.write_bytes(bytes(data))
    release = read_release(copy)
    check_gguf(path, release)
    with pytest.raises(ReleaseError, match="SHA-256 differs") as exc:
        check_gguf(path, release, hashed=True)
    _one_line(exc)
    path.write_bytes(b"PK\x03\x04" + bytes(data[4:]))
    with pytest.raises(ReleaseError, match=r"not a GGUF file \(starts with b'PK\\x03\\x04'") as exc:
        check_gguf(path, release)
    _one_line(exc)


REQUEST = {"model": "clef-test", "state": "card declined twice",
           "questions": {"kind": {"type": "choice", "criteria": {"card": "A card problem", "other": None}}}}


@pytest.mark.parametrize("command", [
    ["quantize", "--bits", "8"], ["quantize", "--format", "mixed", "--max-kl", "0.002"], ["export-onnx"],
    ["decide", "--backend", "torch"], ["drift", "--backend", "torch", "--limit", "2", "--no-progress"]])
def test_a_gguf_release_where_safetensors_are_read_is_one_line(command: list[str], copy: Path, tiny_qwen: Path,
                                                               tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """quantize and export-onnx with the GGUF release as --model, decide on torch, drift with it as --reference: one
    line naming --backend llamacpp and the source release gguf_config.json records, before anything is written."""
    from clef_local.cli import main

    name, *options = command
    out = tmp_path / "out"
    if name in ("quantize", "export-onnx"):
        argv = [name, "--model", str(copy), "--out", str(out), *options]
    elif name == "decide":
        (tmp_path / "request.json").write_text(json.dumps(REQUEST))
        argv = [name, "--model", str(copy), "--request", str(tmp_path / "request.json"), *options]
    else:
        argv = [name, "--reference", str(copy), "--candidate", str(tiny_qwen), *options]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {copy} is a GGUF release") and "\n" not in err, err
    assert "--backend llamacpp" in err and f"the source release ({tiny_qwen})" in err, err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_a_gguf_read_as_safetensors_is_one_line(copy: Path) -> None:
    """Any other path that reaches gguf/model.gguf expecting safetensors (a census, a skeleton's headers)."""
    from clef_local.formats.safetensors import read_header
    from clef_local.planning.census import census_from_release

    release = read_release(copy)
    for read in (lambda: read_header(release.gguf),
                 lambda: census_from_release(release.path, release.weight_files, release.config)):
        with pytest.raises(ReleaseError) as exc:
            read()
        assert _one_line(exc) == (f"{release.gguf}: a GGUF file (llama.cpp's), not safetensors: run its release with "
                                  f"--backend llamacpp, or give this command the source release")
