"""How far a head reads a record, from its weights: the runtime stops the backbone after the last question span (a
question-path head) or the last option span (the option context live too), with the same probabilities on every
backend, and never for a head that reads the memory, the last token or the prior."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import clef_local
from clef_local.formats.release import HEAD_WEIGHTS, read_release
from clef_local.heads.torch_head import JointSchemaHead
from clef_local.runtime.head_reach import (
    Reach,
    head_reach,
    question_reach,
    reach_of,
    reads_question_spans_only,
    record_reach,
)
from clef_local.training.question_path import question_path_head

OPTIONS = {f"intent_{i}": (f"the customer asks about topic number {i}" if i % 3 else None) for i in range(24)}
REQUESTS = [
    {"model": "m", "state": "My card payment was declined twice at the supermarket today.",
     "questions": {"intent": {"type": "choice", "instructions": "What does the customer want?", "criteria": OPTIONS}}},
    {"model": "m", "state": {"messages": ["hello", "I was charged twice for one coffee"], "tier": "gold"},
     "questions": {"refund": {"type": "noul", "instructions": "Does the customer want money back?"},
                   "topic": {"type": "choice", "criteria": {"cards": None, "fees": "charges and fees",
                                                            "transfers": None}},
                   "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]}}},
    {"model": "m", "state": "Where is my new card?",
     "questions": {"q7": {"type": "noul", "criteria": {"true": "the card has not arrived"}}}},
]


@pytest.fixture(scope="module")
def question_path_release(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama release with a question-path head whose trainable tensors are random (every one matters)."""
    path = tmp_path_factory.mktemp("reach") / "release"
    shutil.copytree(tiny_llama, path)
    head = JointSchemaHead(read_release(path).head_config)
    head.load_state_dict(load_file(path / HEAD_WEIGHTS))
    torch.manual_seed(0)
    with torch.no_grad():
        for param in question_path_head(head, 3.0):
            param.add_(torch.randn_like(param))
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, path / HEAD_WEIGHTS)
    return path


@pytest.fixture(scope="module")
def option_path_release(question_path_release: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The question-path release with its option-context projection live (random): it reads the option spans."""
    path = tmp_path_factory.mktemp("reach-options") / "release"
    shutil.copytree(question_path_release, path)
    state = load_file(path / HEAD_WEIGHTS)
    torch.manual_seed(1)
    state["option_context_projection.weight"] = torch.randn_like(state["option_context_projection.weight"]) * 0.2
    save_file({k: v.contiguous() for k, v in state.items()}, path / HEAD_WEIGHTS)
    return path


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in load_file(path / HEAD_WEIGHTS).items()}


def test_the_predicate_needs_every_far_branch_off(tiny_llama: Path, question_path_release: Path):
    assert not reads_question_spans_only(_tensors(tiny_llama))  # a random head reads everything
    tensors = _tensors(question_path_release)
    assert reads_question_spans_only(tensors)
    for name in ("option_context_projection.weight", "global_projection.weight",
                 "evidence_layers.0.attention.out_proj.weight", "layers.1.multihead_attn.out_proj.weight"):
        live = dict(tensors)
        live[name] = tensors[name].copy()
        live[name][0, 0] = 1e-4
        assert not reads_question_spans_only(live), name
    assert not reads_question_spans_only({**tensors, "prior_logit_scale": np.array(-10.0, dtype=np.float32)})
    # the routing layers' feed-forward and the field layers' self-attention read the options, not the backbone
    assert reads_question_spans_only({**tensors, "layers.0.self_attn.out_proj.weight": np.ones((32, 32))})


def test_the_reach_is_the_farthest_branch_that_is_live(tiny_llama: Path, question_path_release: Path,
                                                       option_path_release: Path):
    tensors = _tensors(question_path_release)
    assert reach_of(tensors) is Reach.QUESTION_SPANS
    options_live = _tensors(option_path_release)
    assert reach_of(options_live) is Reach.OPTION_SPANS
    for name in ("global_projection.weight", "evidence_layers.0.attention.out_proj.weight",
                 "layers.0.multihead_attn.out_proj.weight"):
        live = dict(options_live)
        live[name] = tensors[name] + 1e-4
        assert reach_of(live) is Reach.WHOLE_RECORD, name
    assert reach_of({**tensors, "prior_logit_scale": np.array(-10.0, dtype=np.float32)}) is Reach.WHOLE_RECORD
    assert [head_reach(p / HEAD_WEIGHTS) for p in (question_path_release, option_path_release, tiny_llama)] == [
        Reach.QUESTION_SPANS, Reach.OPTION_SPANS, Reach.WHOLE_RECORD]


def _probabilities(model: clef_local.ClefModel) -> list[np.ndarray]:
    return [p for prediction in model.predict(REQUESTS, batch_size=3) for p in prediction.probabilities]


@pytest.mark.parametrize("backend", ["torch", "onnx", "mlx"])
def test_the_cut_pass_gives_the_whole_records_probabilities(question_path_release: Path, tmp_path: Path,
                                                           backend: str):
    path = question_path_release
    if backend == "onnx":
        pytest.importorskip("onnxruntime")
        from clef_local.export.onnx.export import export_onnx

        path = Path(export_onnx(question_path_release, tmp_path / "onnx", "fp32", validate=False)["out"])
    elif backend == "mlx":
        pytest.importorskip("mlx.core")
    model = clef_local.load(path, backend=backend, dtype="float32")
    assert model.reach is Reach.QUESTION_SPANS
    assert model.describe()["backbone_pass"] == "to the last question span"
    cut = _probabilities(model)
    model.reach = Reach.WHOLE_RECORD
    whole = _probabilities(model)
    assert [p.shape for p in cut] == [p.shape for p in whole] == [(24,), (2,), (3,), (3,), (2,)]
    # float32 noise only: the backbone's matmuls over a shorter sequence round differently (~1e-6 relative)
    assert max(float(np.abs(a - b).max()) for a, b in zip(cut, whole, strict=True)) < 2e-5
    assert max(float(p.max() - p.min()) for p in whole) > 0.05  # the head discriminates: not a test of constants


def test_a_head_that_reads_option_spans_gets_them_and_the_whole_records_probabilities(option_path_release: Path):
    # the cold pass (a cached state continues through the backbone's forward instead: the last test here)
    model = clef_local.load(option_path_release, backend="torch", dtype="float32", state_cache=0)
    assert model.reach is Reach.OPTION_SPANS and model.describe()["backbone_pass"] == "to the last option span"
    seen: list[int] = []
    original = model.backend.backbone.hidden_states

    def spy(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        seen.append(input_ids.shape[1])
        return original(input_ids, attention_mask)

    model.backend.backbone.hidden_states = spy
    cut = _probabilities(model)
    for request in REQUESTS:  # one at a time: each pass stops at that record's last option span
        seen.clear()
        (prediction,) = model.predict([request])
        assert seen == [record_reach(prediction.encoded, Reach.OPTION_SPANS)]
        assert question_reach(prediction.encoded) < seen[0] < len(prediction.encoded.input_ids)
    model.reach = Reach.WHOLE_RECORD
    whole = _probabilities(model)
    assert max(float(np.abs(a - b).max()) for a, b in zip(cut, whole, strict=True)) < 2e-5
    assert max(float(p.max() - p.min()) for p in whole) > 0.05


def test_the_backbone_runs_to_the_last_question_span_only(question_path_release: Path, tiny_llama: Path):
    # the cold pass (tests/test_state_cache.py checks that a continuation from a cached state stops there too)
    model = clef_local.load(question_path_release, backend="torch", dtype="float32", state_cache=0)
    seen: list[int] = []
    original = model.backend.backbone.hidden_states

    def spy(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        seen.append(input_ids.shape[1])
        return original(input_ids, attention_mask)

    model.backend.backbone.hidden_states = spy
    prediction = model.predict(REQUESTS[:1])[0]
    assert seen == [question_reach(prediction.encoded)]
    assert seen[0] < len(prediction.encoded.input_ids) / 3  # the 24 options are after the question span

    full = clef_local.load(tiny_llama, backend="torch", dtype="float32")
    assert full.reach is Reach.WHOLE_RECORD
    assert full.describe()["backbone_pass"] == "whole record"


def test_a_cached_state_continues_only_to_the_last_question_span(question_path_release: Path):
    from clef_local.backends.torch_cache import state_end
    from clef_local.runtime.head_reach import batch_reach

    model = clef_local.load(question_path_release, backend="torch", dtype="float32", state_cache="64MiB")
    cold = clef_local.load(question_path_release, backend="torch", dtype="float32", state_cache=0)
    assert model.reach is Reach.QUESTION_SPANS and model.state_cache.enabled
    lengths: list[int] = []
    original = model.backend.backbone.forward

    def spy(input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: object) -> torch.Tensor:
        lengths.append(input_ids.shape[1])
        return original(input_ids, attention_mask, **kwargs)

    model.backend.backbone.forward = spy
    request = REQUESTS[0]
    model.decide(request)
    encoded = model.encode(request)[1]
    # the state pass, then the schema up to the question span's end (not the 24 options after it)
    assert lengths == [state_end(encoded), batch_reach([encoded], model.reach) - state_end(encoded)]
    other = {**request, "questions": {"q": {"type": "noul", "instructions": "Is the card blocked?"}}}
    got = [p for prediction in model.predict([request, other]) for p in prediction.probabilities]
    want = [p for prediction in cold.predict([request, other]) for p in prediction.probabilities]
    assert model.state_cache.stats().hits == 2
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, want, strict=True)) < 2e-5
