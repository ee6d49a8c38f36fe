"""Parity with Cloudflare's reference implementation (the oracle) on tiny random releases, in float32.

(a) token ids and spans equal to the reference ``encode_record``; (b) probabilities within 1e-5 of the reference
model, and the full rounded answer JSON equal with ``confidence="reference"``.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from request_gen import varied_requests

import clef_local
from clef_local.errors import MaxTokensExceededError
from clef_local.runtime.answers import round_floats
from clef_local.runtime.encoding import encode_request
from clef_local.runtime.schema import validate_request
from clef_local.runtime.tokenizer import ReleaseTokenizer

REQUESTS = varied_requests(40, seed=0)


def _reference(oracle, path):
    """The reference model (its own head class, loaded strictly) and a processor stand-in for text-only use."""
    import json

    import transformers
    from safetensors.torch import load_file

    config = json.loads((path / "config.json").read_text())
    cls = (transformers.Qwen3_5ForConditionalGeneration if config.get("model_type") == "qwen3_5"
           else transformers.AutoModelForCausalLM)
    backbone = cls.from_pretrained(path, dtype=torch.float32)
    head = oracle.JointSchemaHead(**json.loads((path / "joint_head_config.json").read_text()))
    head.load_state_dict(load_file(path / "joint_head.safetensors"), strict=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return oracle.ClefModel(backbone, head.float()).eval(), SimpleNamespace(tokenizer=tokenizer)


@pytest.fixture(scope="module")
def reference_qwen(oracle, tiny_qwen):
    return _reference(oracle, tiny_qwen)


def _reference_probs(oracle, ref_model, processor, encoded):
    batch = oracle.collate_records([encoded], processor.tokenizer.pad_token_id, torch.device("cpu"))
    with torch.inference_mode():
        logits = ref_model(batch)[0]
    return [q.float().softmax(-1).numpy() for q in logits]


@pytest.mark.parametrize("index", range(len(REQUESTS)))
def test_encoding_matches_reference(oracle, reference_qwen, tiny_qwen, index):
    request = REQUESTS[index]
    _, processor = reference_qwen
    expected = oracle.encode_record(processor.tokenizer, copy.deepcopy(request))
    record = validate_request(request)
    ours = encode_request(ReleaseTokenizer(tiny_qwen), record)
    assert ours.input_ids == expected.input_ids
    assert len(ours.questions) == len(expected.questions)
    for mine, theirs in zip(ours.questions, expected.questions, strict=True):
        assert mine.question_id == theirs.question_id
        assert mine.question_type == theirs.question_type
        assert mine.question_span == theirs.question_span
        assert mine.option_spans == theirs.option_spans
        assert mine.option_ids == theirs.option_ids


def test_probabilities_and_answers_match_reference(oracle, reference_qwen, qwen_model):
    ref_model, processor = reference_qwen
    worst = 0.0
    predictions = qwen_model.predict(REQUESTS)
    for request, prediction in zip(REQUESTS, predictions, strict=True):
        expected = _reference_probs(oracle, ref_model, processor, oracle.encode_record(processor.tokenizer, request))
        for mine, theirs in zip(prediction.probabilities, expected, strict=True):
            worst = max(worst, float(np.abs(mine - theirs).max()))
        reference_json = oracle.systemone(ref_model, processor, copy.deepcopy(request))
        assert round_floats(prediction.response("reference")) == reference_json
    print(f"max |Δp| vs the reference over {len(REQUESTS)} requests: {worst:.2e}")
    assert worst <= 1e-5, f"max |Δp| {worst:.2e} vs the reference"


def test_llama_backbone_matches_reference(oracle, tiny_llama):
    ref_model, processor = _reference(oracle, tiny_llama)
    model = clef_local.load(tiny_llama, dtype="float32")
    for request in REQUESTS[:8]:
        encoded = oracle.encode_record(processor.tokenizer, request)
        expected = _reference_probs(oracle, ref_model, processor, encoded)
        ours = model.predict([request])[0]
        assert ours.encoded.input_ids == encoded.input_ids
        for mine, theirs in zip(ours.probabilities, expected, strict=True):
            np.testing.assert_allclose(mine, theirs, atol=1e-5)


def test_truncate_state_matches_reference(oracle, reference_qwen, tiny_qwen):
    _, processor = reference_qwen
    request = {"model": "m", "state": "word " * 400, "questions": {"q": {"type": "noul"}}}
    record = validate_request(request)
    tokenizer = ReleaseTokenizer(tiny_qwen)
    with pytest.raises(MaxTokensExceededError, match="exceed the context of 200") as info:
        encode_request(tokenizer, record, max_length=200)
    assert info.value.max_tokens == 200 and info.value.input_tokens > 200
    ours = encode_request(tokenizer, record, max_length=200, truncate_state=True)
    expected = oracle.encode_record(processor.tokenizer, request, max_length=200)
    assert ours.input_ids == expected.input_ids and len(ours.input_ids) == 200
    assert ours.truncated_tokens > 0
    assert [q.option_spans for q in ours.questions] == [q.option_spans for q in expected.questions]


def test_schema_alone_too_long_is_refused(tiny_qwen):
    request = {"model": "m", "state": "s", "questions": {f"q{i}": {"type": "noul"} for i in range(10)}}
    record = validate_request(request)
    with pytest.raises(MaxTokensExceededError, match="schema alone needs"):
        encode_request(ReleaseTokenizer(tiny_qwen), record, max_length=50, truncate_state=True)


def test_decide_batch_equals_single_decides(qwen_model, monkeypatch):
    requests = REQUESTS[:8]
    monkeypatch.setattr(qwen_model, "pad_waste", float("inf"))  # one padded batch whatever the device allows
    batched = qwen_model.predict(requests, batch_size=8)
    for request, together in zip(requests, batched, strict=True):
        alone = qwen_model.predict([request])[0]
        for a, b in zip(alone.probabilities, together.probabilities, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    responses = qwen_model.decide_batch(requests)
    assert [set(r["answers"]) for r in responses] == [set(q["questions"]) for q in requests]
