"""Release reading: broken head files and configs fail to load with a message naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import clef_local
from clef_local.errors import ReleaseError
from clef_local.formats.release import read_release


@pytest.fixture()
def release_copy(tiny_qwen: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(tiny_qwen, target)
    return target


def _rewrite_head(path: Path, edit) -> None:
    state = load_file(path / "joint_head.safetensors")
    edit(state)
    save_file({k: v.contiguous() for k, v in state.items()}, path / "joint_head.safetensors")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.pop("residual_gate"), "missing tensors: residual_gate"),
        (lambda s: s.__setitem__("extra.weight", torch.zeros(2)), "unexpected tensors: extra.weight"),
        (lambda s: s.__setitem__("type_embedding.weight", torch.zeros(4, 32)),
         r"mis-shaped tensors: type_embedding.weight \[4, 32\] \(expected \[3, 32\]\)"),
    ],
    ids=["missing", "extra", "mis-shaped"],
)
def test_bad_head_tensors_are_named(release_copy: Path, edit, message: str):
    _rewrite_head(release_copy, edit)
    with pytest.raises(ReleaseError, match=message):
        clef_local.load(release_copy)


def test_unknown_head_config_key_is_named(release_copy: Path):
    config_file = release_copy / "joint_head_config.json"
    config = json.loads(config_file.read_text())
    config["temperature"] = 2.0
    config_file.write_text(json.dumps(config))
    with pytest.raises(ReleaseError, match=r"unknown key.*temperature"):
        read_release(release_copy)


def test_missing_head_config_key_and_wrong_hidden_size(release_copy: Path):
    config_file = release_copy / "joint_head_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({k: v for k, v in config.items() if k != "heads"}))
    with pytest.raises(ReleaseError, match=r"missing key.*heads"):
        read_release(release_copy)
    config_file.write_text(json.dumps({**config, "hidden_size": 128}))
    with pytest.raises(ReleaseError, match="hidden_size 128 does not match the backbone's hidden_size 64"):
        read_release(release_copy)


def test_truncated_head_file_is_named(release_copy: Path):
    head = release_copy / "joint_head.safetensors"
    head.write_bytes(head.read_bytes()[:-100])
    with pytest.raises(ReleaseError, match=r"joint_head\.safetensors"):
        clef_local.load(release_copy)


def test_missing_files_are_named(release_copy: Path, tmp_path: Path):
    with pytest.raises(ReleaseError, match="is not a directory"):
        read_release(tmp_path / "nowhere")
    (release_copy / "model.safetensors").unlink()
    with pytest.raises(ReleaseError, match="no backbone weights"):
        read_release(release_copy)


def test_reference_code_in_release_is_never_imported(qwen_model):
    # The tiny release's joint_schema_model.py raises when imported; loading and deciding never touch it.
    assert (qwen_model.path / "joint_schema_model.py").read_text().count("RuntimeError") >= 1
    response = qwen_model.decide({"model": "m", "state": "hi", "questions": {"q": {"type": "noul"}}})
    assert 0.0 <= response["answers"]["q"]["noul"] <= 1.0


def test_sharded_release_gives_the_same_answers(tmp_path: Path, qwen_model):
    from clef_local.testing import build_tiny_release

    sharded = build_tiny_release(tmp_path / "sharded", backbone="qwen3_5", seed=0, shards=3)
    assert len(read_release(sharded).weight_files) == 3
    request = {"model": "m", "state": "same weights", "questions": {"q": {"type": "score", "criteria": ["a", "b"]}}}
    a = clef_local.load(sharded, dtype="float32").decide(request)
    assert a == qwen_model.decide(request)


def test_describe_reports_the_release(qwen_model):
    info = qwen_model.describe()
    assert info["architecture"] == "Qwen3_5ForConditionalGeneration"
    assert info["head_config"]["width"] == 32 and info["head_dtype"] == "float32"
    assert info["backbone_dtype"] == "float32" and info["vision_tower"] is True
    assert info["context"] == 65536  # the published window; the backbone allows 262,144


def _rewrite_header(file: Path, edit) -> None:
    """Rewrite ``file``'s JSON header with ``edit(header, last)`` (``last``: the tensor whose data ends the file),
    keeping its data section as it is."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    edit(header, header[last])
    new = json.dumps(header).encode()
    file.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-100])


def _offsets_past_the_end(file: Path) -> None:
    def edit(header, last):
        last["data_offsets"] = [x + 1_000_000 for x in last["data_offsets"]]

    _rewrite_header(file, edit)


def _wrong_shape(file: Path) -> None:
    def edit(header, last):
        last["shape"] = [*last["shape"][:-1], last["shape"][-1] + 1] if last["shape"] else [2]

    _rewrite_header(file, edit)


def _garble_header(file: Path) -> None:
    raw = file.read_bytes()
    file.write_bytes(raw[:8] + b"#" + raw[9:])  # the JSON object's opening brace


CORRUPTIONS = {
    "truncated": (_truncate, r"truncated: data section of \d+ bytes, the header's offsets need \d+"),
    "offsets-past-the-end": (_offsets_past_the_end, r"past the end of the data section"),
    "wrong-shape": (_wrong_shape, r"spans \d+ bytes, its dtype and shape \(\w+ \[[\d, ]*\]\) need \d+"),
    "garbled-header": (_garble_header, r"garbled header: "),
}


@pytest.mark.parametrize("weights", ["model.safetensors", "joint_head.safetensors"])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupted_weight_file_fails_to_load_with_one_line(release_copy: Path, weights: str,
                                                             corruption: str) -> None:
    """Truncated data, bogus offsets, a shape that does not fill its span, a garbled header: one ReleaseError naming
    the file and what is wrong, from clef_local.load and from the torch backend itself (which checks every header
    before safetensors or transformers read a byte of data)."""
    from clef_local.backends.torch_backend import TorchBackend

    file = release_copy / weights
    corrupt, message = CORRUPTIONS[corruption]
    corrupt(file)
    release = read_release(release_copy)  # no manifest: the configs and the file list are all it checks
    for load in (lambda: clef_local.load(release_copy, dtype="float32"),
                 lambda: TorchBackend(release, dtype="float32")):
        with pytest.raises(ReleaseError, match=message) as info:
            load()
        assert str(info.value).startswith(f"{file}: ") and "\n" not in str(info.value)


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_cli_decide_on_a_corrupted_release_prints_one_error_line(release_copy: Path, corruption: str) -> None:
    import subprocess
    import sys

    file = release_copy / "model.safetensors"
    CORRUPTIONS[corruption][0](file)
    result = subprocess.run([sys.executable, "-m", "clef_local.cli", "decide", "--model", str(release_copy),
                             "--example", "triage"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {file}: "), result.stderr
    assert result.stdout == ""
