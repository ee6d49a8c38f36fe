"""clef_local.backends.llamacpp_context: per-token hidden states of a GGUF through llama.cpp's low-level API.

F32 GGUFs of the tiny llama and tiny Qwen3.5 releases, an F32 KV cache: the states equal clef-local's torch backbone
in float32 on the same token ids (≤ 1e-4 relative); a request decoded in chunks equals one pass; the memory is
cleared between requests; a request longer than the context is refused, never cut; llama.cpp's log goes to Python
logging, quiet at INFO. Skipped without llama-cpp-python.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'clef-local[gguf]')")

from gguf_runner import torch_hidden_states

from clef_local.backends.llamacpp_context import LOG_NAME, LlamaCppContext, LlamaCppError, gpu_layers_for
from clef_local.errors import MaxTokensExceededError
from clef_local.export.gguf.convert import write_gguf
from clef_local.formats.release import read_release

TOLERANCE = 1e-4  # max |Δh| / max |h| (the bar for F32 weights with an F32 KV cache)


@pytest.fixture(scope="module")
def f32(tiny_llama: Path, tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("llamacpp-context")
    files = {"llama": out / "llama-F32.gguf", "qwen": out / "qwen-F32.gguf"}
    write_gguf(read_release(tiny_llama), files["llama"], "F32")
    write_gguf(read_release(tiny_qwen), files["qwen"], "F32")
    return files


def _ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 500, n)  # the tiny tokenizer has 513 ids


@pytest.mark.parametrize("backbone", ["llama", "qwen"])
def test_hidden_states_match_torch_float32(backbone: str, f32: dict[str, Path], tiny_llama: Path,
                                           tiny_qwen: Path) -> None:
    ids = _ids(300, seed=3)
    # chunks of 128: the comparison also crosses two decode boundaries (Qwen3.5: its recurrent state carried)
    with LlamaCppContext(f32[backbone], context=512, chunk=128, kv_type="f32") as ctx:
        got = ctx.hidden_states(ids)
    want = torch_hidden_states(tiny_llama if backbone == "llama" else tiny_qwen, ids.tolist())
    assert got.shape == want.shape == (300, 64) and got.dtype == np.float32
    assert np.abs(got - want).max() / np.abs(want).max() <= TOLERANCE


def test_chunked_decode_equals_one_pass(f32: dict[str, Path]) -> None:
    ids = _ids(400, seed=4)
    with LlamaCppContext(f32["qwen"], context=512, chunk=512, kv_type="f32") as whole, \
            LlamaCppContext(f32["qwen"], context=512, chunk=64, kv_type="f32") as pieces:
        assert (whole.n_batch, pieces.n_batch) == (512, 64)
        one, chunked = whole.hidden_states(ids), pieces.hidden_states(ids)
    np.testing.assert_allclose(chunked, one, rtol=0, atol=1e-6 * np.abs(one).max())


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_memory_is_cleared_between_requests(kv_type: str, f32: dict[str, Path]) -> None:
    first, other = _ids(200, seed=5), _ids(150, seed=6)
    with LlamaCppContext(f32["qwen"], context=256, chunk=64, kv_type=kv_type) as ctx:
        a = ctx.hidden_states(first)
        b = ctx.hidden_states(other)
        again = ctx.hidden_states(first)
        fresh = LlamaCppContext(f32["qwen"], context=256, chunk=64, kv_type=kv_type)
        alone = fresh.hidden_states(other)
        fresh.close()
    assert np.array_equal(a, again)  # bit for bit: nothing of the request between them remains
    assert np.array_equal(b, alone)  # and nothing of the first request reached the second
    assert not np.array_equal(a[:150], b)


def test_a_long_request_is_refused_never_cut(f32: dict[str, Path]) -> None:
    with LlamaCppContext(f32["llama"], context=256, chunk=64, kv_type="f16") as ctx:
        assert ctx.n_ctx == 256
        with pytest.raises(MaxTokensExceededError, match=r"257 tokens; this llama.cpp context holds 256"):
            ctx.hidden_states(_ids(257, seed=7))
        assert ctx.hidden_states(_ids(256, seed=7)).shape == (256, 64)  # the whole context, in four chunks
        with pytest.raises(ValueError, match="at least one token"):
            ctx.hidden_states([])
    assert ctx.closed
    with pytest.raises(LlamaCppError, match="closed"):
        ctx.hidden_states([1, 2])


def test_f16_kv_cache_is_close_but_not_exact(f32: dict[str, Path], tiny_qwen: Path) -> None:
    ids = _ids(200, seed=8)
    with LlamaCppContext(f32["qwen"], context=256, kv_type="f16") as ctx:
        got = ctx.hidden_states(ids)
        assert ctx.describe()["kv_cache"] == "f16"
    want = torch_hidden_states(tiny_qwen, ids.tolist())
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2


def test_llama_cpp_logs_to_python_logging_quietly(f32: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=LOG_NAME):
        LlamaCppContext(f32["llama"], context=256, kv_type="f32").close()
    lines = [r for r in caplog.records if r.name == LOG_NAME]
    assert any("llama_kv_cache" in r.getMessage() for r in lines)  # the load's lines arrive, whole
    assert all("\n" not in r.getMessage() for r in lines)
    # a normal load says nothing at INFO or above (its expected warnings — pooling none — are demoted too)
    assert [r.getMessage() for r in lines if r.levelno >= logging.INFO] == []


def test_gpu_layers_name_the_build_flag() -> None:
    assert gpu_layers_for("cpu", supports_gpu=False) == 0
    assert gpu_layers_for("cuda:1", supports_gpu=True) > 1000
    with pytest.raises(LlamaCppError, match=r'built for the CPU only.*CMAKE_ARGS="-DGGML_CUDA=on"'):
        gpu_layers_for("cuda", supports_gpu=False)
    with pytest.raises(LlamaCppError, match=r'CMAKE_ARGS="-DGGML_METAL=on"'):
        gpu_layers_for("mps", supports_gpu=False)
    with pytest.raises(LlamaCppError, match="not 'tpu'"):
        gpu_layers_for("tpu", supports_gpu=True)
