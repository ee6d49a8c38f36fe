"""The core proof of the GGUF export: a tiny llama and a tiny Qwen3.5 release converted to F32 and run by llama.cpp
(low-level API, embeddings on, pooling NONE, an F32 KV cache, flash attention off) give the per-token hidden states of
clef-local's torch backbone in float32 to 1e-4 relative (max |Δh| / max |h|); llama.cpp's quantizer writes Q8_0 and
Q4_K_M with the output rows kept at the source precision, as the file read back says. Skipped without llama-cpp-python.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'clef-local[gguf]')")

from gguf_runner import hidden_states, torch_hidden_states

from clef_local.export.gguf.convert import write_gguf
from clef_local.export.gguf.quantize import quantize_gguf, tensor_types
from clef_local.formats.release import read_release

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def f32(tiny_llama: Path, tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf-llamacpp")
    files = {"llama": out / "llama-F32.gguf", "qwen": out / "qwen-F32.gguf"}
    write_gguf(read_release(tiny_llama), files["llama"], "F32")
    write_gguf(read_release(tiny_qwen), files["qwen"], "F32")
    return files


def _token_ids(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


@pytest.mark.parametrize("backbone", ["llama", "qwen"])
def test_f32_hidden_states_match_torch(backbone: str, f32: dict[str, Path], tiny_llama: Path,
                                       tiny_qwen: Path) -> None:
    release = tiny_llama if backbone == "llama" else tiny_qwen
    ids = _token_ids(48, 500, seed=7)
    got = hidden_states(f32[backbone], ids)
    want = torch_hidden_states(release, ids)
    assert got.shape == want.shape == (48, 64)
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    assert rel <= TOLERANCE, f"{backbone}: max |Δh| / max |h| = {rel:.2e}"


def test_quantized_types_read_back(tiny_qwen: Path, tiny_llama: Path, tmp_path: Path) -> None:
    for name, release in (("qwen", tiny_qwen), ("llama", tiny_llama)):
        bf16 = tmp_path / f"{name}-BF16.gguf"
        written = write_gguf(read_release(release), bf16, "BF16", output_type="BF16")
        for qtype, quantized in (("Q8_0", {"Q8_0"}), ("Q4_K_M", {"Q5_0", "Q8_0"})):
            out = tmp_path / f"{name}-{qtype}.gguf"
            seen: list[int] = []
            quantize_gguf(bf16, out, qtype, output_type="BF16", threads=1,
                          progress=lambda i, n, s, seen=seen: seen.append(n))
            held = tensor_types(out)
            assert held["file_type"] == f"MOSTLY_{qtype}"
            assert held["tensors"][written.lm_head_tensor] == "BF16"  # the head's rows: the source precision
            assert len(seen) == len(held["tensors"]) and seen[-1] == len(held["tensors"])
            # 64-wide rows are not a multiple of 256: llama.cpp's K-quant mix falls back to Q5_0 / Q8_0 here
            others = {t for n, t in held["tensors"].items() if n != written.lm_head_tensor and t != "F32"}
            assert others and others <= quantized, (name, qtype, held["counts"])
            assert all(held["tensors"][n] == "F32" for n in held["tensors"] if n.endswith("_norm.weight"))
        if name == "qwen":  # still runs, and close to the reference (not a tolerance test: a smoke check)
            ids = _token_ids(16, 500, seed=3)
            got, want = hidden_states(tmp_path / "qwen-Q8_0.gguf", ids), torch_hidden_states(release, ids)
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.1


def test_quantize_error_is_one_line_and_llama_cpp_logs_to_logging_after(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    import llama_cpp

    from clef_local.backends.llamacpp_log import LOG_NAME
    from clef_local.export.staging import ExportError

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 8)
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG, logger=LOG_NAME):
        with pytest.raises(ExportError, match=r"llama.cpp could not quantize bad.gguf to Q8_0: ") as info:
            quantize_gguf(bad, tmp_path / "out.gguf", "Q8_0", output_type=None, threads=1)
        assert "\n" not in str(info.value)
        assert any("failed to quantize" in r.getMessage() for r in caplog.records if r.name == LOG_NAME)
        caplog.clear()
        # the quantizer left the routing in place: llama.cpp's next lines still reach logging, not stderr
        assert not llama_cpp.llama_model_load_from_file(str(bad).encode(), llama_cpp.llama_model_default_params())
    assert any(r.levelno == logging.ERROR for r in caplog.records if r.name == LOG_NAME)
    assert "llama_model_load" not in capfd.readouterr().err
