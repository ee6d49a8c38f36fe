"""Images and video on the llama.cpp backend: the tiny Qwen3.5 vision release exported to an F32 GGUF (its tower kept
as ``gguf/vision.safetensors``), the tower on torch and its rows fed to llama.cpp as input embeddings at transformers'
multimodal rope positions, against the torch backend in float32 on the same records: hidden states at every position
within 1e-4 relative (Frobenius), probabilities within 1e-5, also decoded in chunks that cut an image; text requests
unchanged; a GGUF release without the tower, or without torch, is refused in one line. Skipped without
llama-cpp-python.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'clef-local[gguf]')")

from media_gen import data_uri, image
from request_gen import max_dp, varied_requests

import clef_local
from clef_local.backends.llamacpp_backend import vision_refusal
from clef_local.backends.llamacpp_context import EmbeddingSpan, LlamaCppContext, TokenSpan
from clef_local.errors import ApiUsageError
from clef_local.export.gguf.export import export_gguf
from clef_local.formats.gguf_tensors import gguf_table
from clef_local.formats.release import read_release

HIDDEN_TOLERANCE = 1e-4  # ‖Δh‖_F / ‖h‖_F, F32 GGUF + F32 KV cache against torch float32 (measured 1.6e-7)
# The tiny model rotates 4 frequencies per head (rope_theta 1e7, sections 2/1/1): its width axis turns 3e-4 rad per
# position, so an image's width positions one off move the states only ~1e-5, inside the bar above; this one sees it
POSITION_TOLERANCE = 2e-6
PROBABILITY_TOLERANCE = 1e-5
QUESTIONS = {"damaged": {"type": "noul", "instructions": "Is anything damaged?"},
             "kind": {"type": "choice", "criteria": {"photo": "a photo", "scan": None, "chart": "a chart"}},
             "quality": {"type": "score", "criteria": ["poor", "fine", "sharp"]}}
IMAGES = {"model": "m", "state": {"document": "receipt", "page": 2},
          "images": [data_uri(image(64, 64, seed=1)), data_uri(image(257, 129, seed=2)), data_uri(image(33, 90))],
          "questions": QUESTIONS}
VIDEO = {"model": "m", "state": "What happens in the clip?", "images": [data_uri(image(64, 96, seed=4))],
         "videos": [[data_uri(image(96, 64, seed=10 + i)) for i in range(5)]], "questions": QUESTIONS}


class FramesProcessor:
    """Stands in for Qwen3-VL's video processor, which needs torchvision: deterministic arrays of the shapes it gives
    (16-pixel patches, 2 frames per temporal patch, 2×2 merge) and its metadata. Both backends read the same
    arrays; the processor's own parity with the reference is tests/test_vision_parity.py's."""

    merge_size = 2
    temporal_patch_size = 2

    def __call__(self, videos: list[list[Any]], **_: Any) -> dict[str, Any]:
        grids, pixels, metadata = [], [], []
        for i, frames in enumerate(videos):
            width, height = frames[0].size
            grid = [-(-len(frames) // 2), height // 16, width // 16]
            grids.append(grid)
            rng = np.random.default_rng(i)
            pixels.append(rng.normal(0, 1, (int(np.prod(grid)), 3 * 2 * 16 * 16)).astype(np.float32))
            metadata.append(SimpleNamespace(fps=2.0, frames_indices=list(range(len(frames)))))
        return {"pixel_values_videos": np.concatenate(pixels), "video_grid_thw": np.array(grids),
                "video_metadata": metadata}


@pytest.fixture(scope="module")
def gguf_vision(tiny_vision: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llamacpp-vision") / "gguf"
    export_gguf(tiny_vision, out, "F32", validate=False)
    assert (out / "gguf" / "vision.safetensors").is_file()
    return out


@pytest.fixture(scope="module")
def models(gguf_vision: Path, vision_model) -> dict[str, Any]:
    out = {"torch": vision_model,
           "llamacpp": clef_local.load(gguf_vision, dtype="float32", max_length=4096),
           "chunked": clef_local.load(gguf_vision, dtype="float32", max_length=4096, prefill_chunk=32)}
    for model in out.values():  # the same stand-in on each: equal records
        model.encoder.media.processor._video_processor = FramesProcessor()
    return out


def _hidden(model: Any, record: Any) -> np.ndarray:
    """The backbone's final hidden states of one record, ``[T, hidden]`` float32."""
    ids, mask = np.array([record.input_ids]), np.ones((1, len(record.input_ids)), dtype=np.int64)
    if model.backend.name == "llamacpp":
        return model.backend.hidden_states(ids, mask, [record])[0]
    import torch

    from clef_local.backends.torch_pass import collate, hidden_states

    backend, pad = model.backend, model.tokenizer.pad_token_id
    with torch.inference_mode():
        return hidden_states(backend.backbone, [record], *collate([record], pad, backend.device), pad)[0].numpy()


@pytest.mark.parametrize("request_", [IMAGES, VIDEO], ids=["images", "video"])
def test_media_match_torch_float32(request_: dict[str, Any], models: dict[str, Any]) -> None:
    torch_model, gguf = models["torch"], models["llamacpp"]
    assert gguf.backend.name == "llamacpp" and gguf.backend.accepts_media
    record = gguf.encode(request_)
    assert record.input_ids == torch_model.encode(request_).input_ids and record.media is not None
    assert record.media.visual_tokens > 80 and (record.media.videos == 1) == ("videos" in request_)
    want = _hidden(torch_model, record)
    assert models["chunked"].backend.context.n_batch == 32
    reference = torch_model.predict([request_])
    for name in ("llamacpp", "chunked"):  # chunks of 32 cut the images: their rows span several decodes
        got = _hidden(models[name], record)
        relative = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        dp = max_dp(models[name].predict([request_]), reference)
        print(f"{name} {'video' if 'videos' in request_ else 'images'}: {len(want)} positions "
              f"({record.media.visual_tokens} visual), hidden ‖Δ‖/‖h‖ {relative:.2e}, max |Δp| {dp:.2e}")
        assert relative <= min(HIDDEN_TOLERANCE, POSITION_TOLERANCE)
        assert dp <= PROBABILITY_TOLERANCE
    info = gguf.backend.describe()["vision"]
    assert info == "gguf/vision.safetensors on torch, float32 on cpu"


def test_a_position_one_off_is_seen(models: dict[str, Any]) -> None:
    """The control: the image rows' width positions one off (still in raster order) fail POSITION_TOLERANCE."""
    backend = models["llamacpp"].backend
    record = models["llamacpp"].encode(IMAGES)
    want = _hidden(models["torch"], record)
    shift = np.array([[0], [0], [1]])
    spans = [EmbeddingSpan(s.rows, s.positions + shift) if isinstance(s, EmbeddingSpan) else s
             for s in backend.vision().spans(record)]
    relative = float(np.linalg.norm(backend.context.decode(spans) - want) / np.linalg.norm(want))
    print(f"width positions +1: hidden ‖Δ‖/‖h‖ {relative:.2e}")
    assert relative > 3 * POSITION_TOLERANCE


def test_text_requests_are_unchanged(models: dict[str, Any]) -> None:
    torch_model = models["torch"]
    requests = [r for r in varied_requests(8, seed=5) if len(torch_model.encode(r).input_ids) < 4096]
    assert len(requests) >= 3
    assert max_dp(models["llamacpp"].predict(requests), torch_model.predict(requests)) <= PROBABILITY_TOLERANCE


def test_embedding_rows_equal_their_tokens(gguf_vision: Path) -> None:
    """The embeddings batch (four positions per row, section-major) is the token batch when the rows are the
    tokens' own embedding rows at (p, p, p): the layout llama.cpp reads is the one written."""
    file = gguf_vision / "gguf" / "model.gguf"
    ids = np.random.default_rng(0).integers(0, 500, 90)
    rows = gguf_table(file).rows("token_embd.weight", ids[30:70])
    positions = np.arange(90)
    with LlamaCppContext(file, context=256, chunk=32, kv_type="f32") as ctx:
        tokens = ctx.hidden_states(ids)
        spans = ctx.decode([TokenSpan(ids[:30], positions[:30]),
                            EmbeddingSpan(rows, np.broadcast_to(positions[30:70], (3, 40))),
                            TokenSpan(ids[70:], positions[70:])])
        with pytest.raises(ValueError, match=r"position 30 of the sequence, \(29, 29, 29\), does not follow"):
            ctx.decode([TokenSpan(ids[:30], positions[:30]), EmbeddingSpan(rows[:2], np.full((3, 2), 29))])
    np.testing.assert_allclose(spans, tokens, rtol=0, atol=1e-5 * np.abs(tokens).max())


def test_without_the_tower_media_are_refused_in_one_line(gguf_vision: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(gguf_vision, bare)
    (bare / "gguf" / "vision.safetensors").unlink()
    (bare / "clef_local_manifest.json").unlink()  # as a GGUF release without the tower leaves it
    model = clef_local.load(bare, max_length=2048)
    assert not model.backend.accepts_media
    with pytest.raises(ApiUsageError) as refused:
        model.decide(IMAGES)
    message = str(refused.value)
    assert "\n" not in message
    assert "has no gguf/vision.safetensors beside its GGUF" in message and "clef-local export-gguf" in message
    assert model.decide({**IMAGES, "images": None})["answers"]["damaged"]["type"] == "noul"


def test_without_torch_media_are_refused_naming_the_install(gguf_vision: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    release = read_release(gguf_vision)
    assert vision_refusal(release) is None
    monkeypatch.setitem(sys.modules, "torch", None)  # find_spec: not installed
    why = vision_refusal(release)
    assert why is not None and "\n" not in why
    assert "run the vision tower on torch, and torch is not installed: pip install torch && pip install clef-local" \
        in why
