"""clef_local.formats.gguf_tensors, the one GGUF header reader: read without gguf-py's per-element reader it gives
gguf-py's metadata (scalars and strings as values, arrays as their lengths), tensor table (names, types, shapes,
bytes, offsets), data section start and, through gguf-py's dequantize, its rows; a cut header, another version and a
bad id are one line each.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from clef_local.errors import ReleaseError
from clef_local.export.gguf.convert import write_gguf
from clef_local.formats.gguf_tensors import ArrayInfo, GgufTable, gguf_table
from clef_local.formats.release import read_release


@pytest.fixture(scope="module")
def files(tiny_llama: Path, tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf-tensors")
    found = {"llama-F32": out / "llama-F32.gguf", "qwen-BF16": out / "qwen-BF16.gguf"}
    write_gguf(read_release(tiny_llama), found["llama-F32"], "F32")
    write_gguf(read_release(tiny_qwen), found["qwen-BF16"], "BF16")
    if importlib.util.find_spec("llama_cpp") is not None:  # a quantized file too: llama.cpp's quantizer writes it
        from clef_local.export.gguf.quantize import quantize_gguf

        found["qwen-Q8_0"] = out / "qwen-Q8_0.gguf"
        quantize_gguf(found["qwen-BF16"], found["qwen-Q8_0"], "Q8_0", output_type=None, threads=1)
    return found


def test_the_table_and_rows_are_gguf_pys(files: dict[str, Path]) -> None:
    for path in files.values():
        table, reader = GgufTable(path), GGUFReader(path)
        assert table.architecture == reader.get_field("general.architecture").contents()
        assert table.field("general.file_type") == reader.get_field("general.file_type").contents()
        assert table.field("tokenizer.ggml.tokens").length == len(reader.get_field("tokenizer.ggml.tokens").data)
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):  # gguf-py's own entries for the header
                continue
            value, mine = field.contents(), table.field(key)
            if isinstance(mine, ArrayInfo):
                assert (mine.type, mine.length) == (int(field.types[-1]), len(value)), key
            else:
                assert mine == (pytest.approx(value) if isinstance(value, float) else value), key
        assert table.data_start == reader.data_offset and table.size == path.stat().st_size
        assert table.version == 3
        assert len(table.tensors) == len(reader.tensors)
        for tensor in reader.tensors:
            mine = table.tensors[tensor.name]
            assert (mine.type, mine.bytes, mine.offset) == (tensor.tensor_type.name, tensor.n_bytes,
                                                            tensor.data_offset)
            assert mine.shape == tuple(int(d) for d in reversed(tensor.shape))
        ids = np.array([3, 0, 511, 3])
        for name in ("token_embd.weight", "output.weight"):
            if name in table.tensors:
                tensor = next(t for t in reader.tensors if t.name == name)
                want = np.asarray(dequantize(tensor.data[ids], tensor.tensor_type), np.float32).reshape(4, -1)
                assert np.array_equal(table.rows(name, ids), want), (path.name, name)
        assert sum(table.type_counts.values()) == len(reader.tensors)
    assert GgufTable(files["llama-F32"]).lexical_tensor == "token_embd.weight"  # tied
    assert GgufTable(files["qwen-BF16"]).lexical_tensor == "output.weight"


def test_a_cut_header_and_a_bad_id_are_one_line(files: dict[str, Path], tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(files["qwen-BF16"].read_bytes()[:2000])  # inside the vocabulary
    with pytest.raises(ReleaseError, match=r"cut.gguf: not a complete GGUF file \(.*runs past the end.*\); the file "
                       r"is truncated") as refused:
        GgufTable(cut)
    assert "\n" not in str(refused.value)
    cut.write_bytes(b"GGUF\x04\x00\x00\x00" + bytes(40))
    with pytest.raises(ReleaseError, match=r"cut.gguf: GGUF version 4, llama.cpp reads 2 or 3; re-export"):
        GgufTable(cut)
    cut.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ReleaseError, match=r"cut.gguf: not a complete GGUF file \(8 bytes, shorter than a GGUF header"):
        GgufTable(cut)
    cut.write_bytes(b"")
    with pytest.raises(ReleaseError, match=r"cut.gguf: not a GGUF file \(starts with b''"):
        GgufTable(cut)
    with pytest.raises(ReleaseError, match=r"outside output\.weight's 520 rows"):
        gguf_table(files["qwen-BF16"]).rows("output.weight", np.array([520]))
