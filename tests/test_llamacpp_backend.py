"""The llama.cpp backend (``backend="llamacpp"``) on tiny GGUF releases written by ``clef-local export-gguf``.

With F32 weights and an F32 KV cache (``dtype="float32"``) its probabilities are torch float32's on the source
release within 1e-5 (measured ~2e-7); the head's lexical rows are the GGUF's own output rows; ``auto`` runs a GGUF
release on llama.cpp and never picks llama.cpp for a safetensors release; media without a vision tower, other
backends and a bad GGUF are refused in one line before llama.cpp reads anything; the planner's KV cache is the one
llama.cpp allocates. Skipped without llama-cpp-python.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'clef-local[gguf]')")

from media_gen import data_uri, image
from request_gen import max_dp, varied_requests

import clef_local
from clef_local.backends.llamacpp_backend import vision_refusal
from clef_local.errors import ApiUsageError, ReleaseError
from clef_local.export.gguf.export import export_gguf
from clef_local.formats.release import read_release
from clef_local.formats.safetensors import bf16_to_float32, read_arrays
from clef_local.planning.gguf_plan import gguf_footprint, gguf_plan
from clef_local.planning.hardware import detect

PROBABILITY_TOLERANCE = 1e-5  # F32 GGUF + F32 KV cache against torch float32 (measured ~2e-7 on these releases)


@pytest.fixture(scope="module")
def gguf(tiny_llama: Path, tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("llamacpp-backend")
    export_gguf(tiny_llama, out / "llama", "F32", validate=False)
    export_gguf(tiny_qwen, out / "qwen", "F32", validate=False)
    return {"llama": out / "llama", "qwen": out / "qwen"}


@pytest.fixture(scope="module")
def llama_model(tiny_llama: Path):
    return clef_local.load(tiny_llama, dtype="float32", backend="torch")


def _foreign(gguf_release: Path, tmp_path: Path) -> Path:
    """The GGUF release as another tool leaves it: the GGUF beside the small files, no gguf_config.json or
    manifest."""
    copy = tmp_path / gguf_release.name
    shutil.copytree(gguf_release, copy)
    (copy / "gguf" / "gguf_config.json").unlink()
    (copy / "clef_local_manifest.json").unlink()
    return copy


@pytest.mark.parametrize("backbone", ["llama", "qwen"])
def test_probabilities_match_torch_float32(backbone: str, gguf: dict[str, Path], qwen_model, llama_model) -> None:
    model = clef_local.load(gguf[backbone], dtype="float32")  # auto: a GGUF release runs on llama.cpp
    assert model.backend.name == "llamacpp"
    assert "a GGUF release runs on llama.cpp" in model.backend.load_decision.reason
    assert model.backend.describe()["kv_cache"] == "float32"
    # the random mixes and the one-question edge (the 64-question schema outgrows the tiny llama's 8,192 tokens);
    # batches of several records, padded: each runs on its own through llama.cpp
    requests = varied_requests(13, seed=11)[:11]
    reference = (llama_model if backbone == "llama" else qwen_model).predict(requests)
    assert max_dp(model.predict(requests, batch_size=4), reference) <= PROBABILITY_TOLERANCE


@pytest.mark.parametrize(("backbone", "tensor"), [("llama", "model.embed_tokens.weight"),
                                                  ("qwen", "lm_head.weight")])
def test_lexical_rows_are_the_ggufs_output_rows(backbone: str, tensor: str, gguf: dict[str, Path],
                                                tiny_llama: Path, tiny_qwen: Path) -> None:
    model = clef_local.load(gguf[backbone], max_length=1024)
    ids = np.array([5, 3, 500, 3, 17])
    got = model.backend.lexical_rows(ids)
    source = read_release(tiny_llama if backbone == "llama" else tiny_qwen)
    stored = read_arrays(source.weight_files[0], lambda name: name == tensor)[tensor]
    assert np.array_equal(got, bf16_to_float32(np.asarray(stored))[ids])  # BF16 → F32 GGUF → float32: exact
    assert model.backend.describe()["lexical_rows"] == ("token_embd.weight" if backbone == "llama"
                                                        else "output.weight")


def test_backend_choice(gguf: dict[str, Path], tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ApiUsageError, match=r"is a GGUF release .* only --backend llamacpp runs it, not torch"):
        clef_local.load(gguf["llama"], backend="torch")
    with pytest.raises(ApiUsageError, match=r"has no gguf/model.gguf; write one with `clef-local export-gguf"):
        clef_local.load(tiny_llama, backend="llamacpp")
    # a safetensors release with a GGUF beside it: auto keeps torch; llamacpp only when asked for
    both = tmp_path / "both"
    shutil.copytree(tiny_llama, both)
    shutil.copytree(gguf["llama"] / "gguf", both / "gguf")
    assert clef_local.load(both, dtype="float32").backend.name == "torch"
    assert clef_local.load(both, backend="llamacpp", max_length=512).backend.name == "llamacpp"


def test_media_need_a_vision_tower(gguf: dict[str, Path]) -> None:
    model = clef_local.load(gguf["llama"], max_length=2048)
    request = {"model": "m", "state": "s", "images": [data_uri(image(64, 64))], "questions": {"q": {"type": "noul"}}}
    with pytest.raises(ApiUsageError) as refused:
        model.decide(request)
    message = str(refused.value)
    assert "\n" not in message
    assert "has no vision tower" in message and not model.backend.accepts_media
    assert model.decide({**request, "images": None})["answers"]["q"]["type"] == "noul"  # text still works
    # Qwen3.5's tower is kept beside the GGUF and runs on torch: tests/test_llamacpp_vision.py
    assert vision_refusal(read_release(gguf["qwen"])) is None


def test_a_gguf_written_by_another_tool_loads(gguf: dict[str, Path], tmp_path: Path) -> None:
    foreign = _foreign(gguf["qwen"], tmp_path)
    model = clef_local.load(foreign, dtype="float32", max_length=2048)
    info = model.backend.describe()
    assert info["written_by"].startswith("another tool") and info["gguf_type"] is None
    assert info["tensor_types"] == {"F32": len(model.backend.table.tensors)}
    request = varied_requests(4, seed=2)[0]
    exported = clef_local.load(gguf["qwen"], dtype="float32", max_length=2048)
    assert max_dp(model.predict([request]), exported.predict([request])) == 0.0


def test_a_bad_gguf_is_refused_before_llama_cpp_reads_it(gguf: dict[str, Path], tmp_path: Path) -> None:
    truncated = _foreign(gguf["llama"], tmp_path / "t")
    file = truncated / "gguf" / "model.gguf"
    file.write_bytes(file.read_bytes()[: file.stat().st_size - 4096])
    with pytest.raises(ReleaseError, match="truncated") as refused:
        clef_local.load(truncated)
    assert "\n" not in str(refused.value)
    swapped = _foreign(gguf["llama"], tmp_path / "s")
    shutil.copyfile(gguf["qwen"] / "gguf" / "model.gguf", swapped / "gguf" / "model.gguf")
    with pytest.raises(ReleaseError, match=r"general.architecture is 'qwen35'"):
        clef_local.load(swapped)


@pytest.mark.parametrize(("backbone", "dtype"), [("llama", None), ("qwen", "float32")])
def test_the_plan_counts_what_llama_cpp_allocates(backbone: str, dtype: str | None, gguf: dict[str, Path],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    release = read_release(gguf[backbone])
    footprint = gguf_footprint(release)
    with caplog.at_level(logging.DEBUG, logger="clef_local.backends.llamacpp_log"):
        model = clef_local.load(gguf[backbone], max_length=4096, dtype=dtype)
    kv = "float32" if dtype == "float32" else "float16"
    planned = gguf_plan(footprint, detect(), context=4096, kv=kv)
    logged = [r.getMessage() for r in caplog.records if "buffer size =" in r.getMessage()]

    def mib(what: str) -> float:
        line = next(m for m in logged if what in m)
        return float(line.split("=")[1].split("MiB")[0])

    assert mib("model buffer size") == pytest.approx(footprint.weights / 2**20, rel=0.01)  # the tensors as stored
    assert mib("KV buffer size") == pytest.approx(planned.kv_cache / 2**20, abs=0.01)  # the KV cache, exactly
    if backbone == "qwen":  # the linear-attention layers' recurrent state, one sequence
        assert mib("RS buffer size") == pytest.approx(planned.recurrent / 2**20, abs=0.01)
    assert planned.compute / 2**20 >= mib("compute buffer size")  # the decode chunk's buffers: never under-counted
    assert model.backend.load_decision.need_bytes == planned.need
    assert model.backend.load_decision.context == 4096


def test_prefill_chunk_sets_the_decode_chunk(gguf: dict[str, Path]) -> None:
    assert clef_local.load(gguf["llama"], max_length=1024, prefill_chunk=64).backend.context.n_batch == 64
    whole = clef_local.load(gguf["llama"], max_length=1024, prefill_chunk=0).backend
    assert whole.context.n_batch == whole.context.n_ctx == 1024
    assert not whole.load_decision.split and whole.prefill.forced_chunk is None


_TORCH_FREE = """
import json, sys
sys.modules["torch"] = None  # any import of torch now fails
import clef_local
model = clef_local.load(sys.argv[1], dtype="float32", max_length=2048)
prediction = model.predict([json.loads(sys.argv[2])])[0]
real = sorted(k for k, v in sys.modules.items() if k.split(".")[0] == "torch" and v is not None)
print(json.dumps({"p": [list(map(float, p)) for p in prediction.probabilities], "torch_modules": real,
                  "backend": model.backend.name}))
"""


def test_a_gguf_release_runs_without_torch(gguf: dict[str, Path], qwen_model) -> None:
    request = varied_requests(4, seed=9)[0]
    result = subprocess.run([sys.executable, "-c", _TORCH_FREE, str(gguf["qwen"]), json.dumps(request)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["torch_modules"] == [] and out["backend"] == "llamacpp"
    for p, q in zip(qwen_model.predict([request])[0].probabilities, out["p"], strict=True):
        assert np.abs(p - np.array(q)).max() <= PROBABILITY_TOLERANCE
