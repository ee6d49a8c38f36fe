"""The one safetensors header reader: what it accepts (whatever ``safetensors`` writes), what it refuses (with one
line naming the file, the tensor and the problem), and the raw arrays it maps."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from clef_local.errors import ReleaseError
from clef_local.formats.safetensors import DTYPES, SafetensorsError, read_arrays, read_header


def _write(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _two_tensors(path: Path) -> Path:
    """``a`` F32 [2, 3] at 0..24, ``b`` I8 [4] at 24..28."""
    header = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "b": {"dtype": "I8", "shape": [4], "data_offsets": [24, 28]}, "__metadata__": {"format": "pt"}}
    return _write(path, header, np.arange(6, dtype="<f4").tobytes() + bytes([1, 2, 3, 255]))


def test_reads_what_safetensors_writes_for_every_torch_dtype(tmp_path: Path) -> None:
    tensors = {name: torch.arange(6).reshape(2, 3).to(getattr(torch, d.torch)) for name, d in DTYPES.items()}
    tensors["empty"] = torch.zeros(0, 5)
    file = tmp_path / "all.safetensors"
    save_file(tensors, file, metadata={"note": "x"})
    header = read_header(file)
    assert set(header) == set(tensors) and header.metadata == {"note": "x"}
    for name, tensor in tensors.items():
        info = header[name]
        assert info.shape == tuple(tensor.shape) and info.nbytes == tensor.numel() * tensor.element_size()
        assert info.spec.itemsize == tensor.element_size()
    assert header.data_start + max(t.end for t in header.tensors.values()) == file.stat().st_size
    arrays = read_arrays(file)
    loaded = load_file(file)
    for name, array in arrays.items():
        assert not array.flags.writeable and array.shape == tuple(loaded[name].shape)
        bits = loaded[name].contiguous().view(torch.uint8).numpy().tobytes()
        assert array.tobytes() == bits, name  # the stored bits, BF16 and F8 included
    assert arrays["F32"].dtype == np.float32 and arrays["BF16"].dtype == np.uint16
    assert sorted(read_arrays(file, select=lambda n: n.startswith("F8"))) == ["F8_E4M3", "F8_E5M2", "F8_E8M0"]


def test_hand_written_file_and_its_arrays(tmp_path: Path) -> None:
    file = _two_tensors(tmp_path / "two.safetensors")
    header = read_header(file)
    assert header["a"].dtype == "F32" and header["b"].begin == 24 and header["b"].end == 28
    arrays = read_arrays(file)
    np.testing.assert_array_equal(arrays["a"], np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(arrays["b"], np.array([1, 2, 3, -1], dtype=np.int8))


def _edit(file: Path, edit) -> Path:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    header, data = edit(header, data)
    return _write(file, header, data)


def _set(name: str, key: str, value):
    def edit(header: dict, data: bytes):
        header[name][key] = value
        return header, data

    return edit


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda f: f.write_bytes(f.read_bytes()[:5]), "truncated: 5 bytes, shorter than the 8-byte header length"),
        (lambda f: f.write_bytes(struct.pack("<Q", 10**9) + f.read_bytes()[8:]), "is not plausible"),
        (lambda f: f.write_bytes(f.read_bytes()[:40]), r"truncated or garbled: header of \d+ bytes does not fit"),
        (lambda f: f.write_bytes(f.read_bytes()[:-3]), r"truncated: data section of 25 bytes, the header's offsets "
                                                        r"need 28 \(tensor 'b' ends there\)"),
        (lambda f: f.write_bytes(f.read_bytes() + b"xx"), "data section of 30 bytes is longer than the 28 bytes"),
        (lambda f: f.write_bytes(f.read_bytes()[:8] + b"[" + f.read_bytes()[9:]), "garbled header: "),
        (lambda f: _write(f, [1, 2], b""), "garbled header: not a JSON object"),
        (lambda f: _edit(f, _set("b", "dtype", "F4")), "tensor 'b' has unknown dtype 'F4'"),
        (lambda f: _edit(f, _set("a", "shape", [2, 4])),
         r"tensor 'a' spans 24 bytes, its dtype and shape \(F32 \[2, 4\]\) need 32"),
        (lambda f: _edit(f, _set("a", "shape", [2, -3])), "garbled header entry for tensor 'a': shape"),
        (lambda f: _edit(f, _set("a", "data_offsets", [24, 0])), "garbled header entry for tensor 'a': data_offs"),
        (lambda f: _edit(f, _set("b", "data_offsets", [1024, 1028])),
         r"tensor 'b' has data_offsets \[1024, 1028\], past the end of the data section \(28 bytes\)"),
        (lambda f: _edit(f, _set("b", "data_offsets", [20, 24])),
         r"tensor 'b' has data_offsets \[20, 24\], overlapping tensor 'a', which ends at byte 24"),
        (lambda f: _edit(f, lambda h, d: ({**h, "b": {**h["b"], "data_offsets": [26, 30]}}, d + b"..")),
         "tensor 'b' has data_offsets \\[26, 30\\], leaving a gap of 2 bytes after tensor 'a'"),
        (lambda f: _edit(f, lambda h, d: ({**h, "a": {"dtype": "F32", "shape": [6]}}, d)),
         "garbled header entry for tensor 'a': no data_offsets"),
        (lambda f: _edit(f, lambda h, d: ({**h, "__metadata__": {"n": 1}}, d)), "__metadata__ is not an object"),
    ],
    ids=["short", "huge-length", "header-cut", "truncated", "extended", "bad-json", "not-object", "dtype",
         "shape-vs-span", "negative-dim", "reversed-offsets", "past-the-end", "overlap", "gap", "no-offsets",
         "metadata"],
)
def test_every_inconsistency_is_one_line_naming_the_file(tmp_path: Path, break_it, message: str) -> None:
    file = _two_tensors(tmp_path / "weights.safetensors")
    break_it(file)
    with pytest.raises(SafetensorsError, match=message) as info:
        read_header(file)
    assert isinstance(info.value, ReleaseError)
    assert str(info.value).startswith(f"{file}: ") and "\n" not in str(info.value)
    assert str(info.value) == f"{file}: {info.value.reason}"


def test_a_missing_file_is_a_release_error(tmp_path: Path) -> None:
    with pytest.raises(ReleaseError, match=r"nowhere\.safetensors: cannot be read"):
        read_header(tmp_path / "nowhere.safetensors")
