"""TorchBackbone's host-embedding path (the default on CUDA) computes exactly what the all-on-device path does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import clef_local
from clef_local.backends.torch_backend import TorchBackbone, collate
from clef_local.formats.release import read_json


def small_requests() -> list[dict]:
    """Requests of different lengths (so the batch is padded) that fit any tiny release's context."""
    return [{"model": "m", "state": "short", "questions": {"ok": {"type": "noul"}}},
            {"model": "m", "state": {"text": "a longer state " * 20}, "questions": {
                "pick": {"type": "choice", "criteria": {"a": "first", "b": None, "c": "third"}},
                "rate": {"type": "score", "criteria": ["low", "mid", "high"]}}}]


@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_llama"])
def test_host_embeddings_give_identical_hidden_states_and_rows(fixture: str, request: pytest.FixtureRequest):
    path: Path = request.getfixturevalue(fixture)
    config = read_json(path / "config.json")
    plain = TorchBackbone(path, config)
    host = TorchBackbone(path, config, host_embeddings=True)
    assert not plain.host_embeddings and host.host_embeddings
    model = clef_local.load(path)
    records = [model.encode(r, truncate_state=True) for r in small_requests()]
    ids, mask = collate(records, 0, torch.device("cpu"))
    assert torch.equal(plain.forward(ids, mask), host.forward(ids, mask))
    rows = torch.tensor([5, 1, 7])
    assert torch.equal(plain.lexical_rows(rows), host.lexical_rows(rows))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_keeps_embeddings_on_the_host(tiny_qwen: Path):
    backbone = clef_local.load(tiny_qwen, device="cuda").backend.backbone
    assert backbone.host_embeddings
    assert backbone.text_model.get_input_embeddings().weight.device.type == "cpu"
    assert backbone.output_embedding.device.type == "cpu"
    on_cuda = [n for n, p in backbone.model.named_parameters() if p.device.type == "cuda"]
    assert on_cuda and all("embed_tokens" not in n and "lm_head" not in n for n in on_cuda)
