"""Images (and video frames, where torchvision works) against Cloudflare's reference, on the tiny vision release in
float32: token ids, modality ids, pixel tensors and grids identical; probabilities within 1e-5; the rounded answers
equal; mixed batches (with and without media) equal one by one; the Jev ``assets`` form equal to the reference form
it maps onto (docs/format.md §7).
"""

from __future__ import annotations

import base64
import copy

import numpy as np
import pytest
from media_gen import (
    data_uri,
    image,
    reference_model,
    reference_probabilities,
    reference_processor,
    vision_requests,
)
from request_gen import varied_requests

import clef_local
from clef_local.errors import RequestValidationError
from clef_local.runtime.answers import round_floats
from clef_local.runtime.media import MediaLimits

REQUESTS = vision_requests(24)


@pytest.fixture(scope="module")
def reference(oracle, tiny_vision):
    return reference_model(oracle, tiny_vision), reference_processor(tiny_vision)


def _reference_encoded(oracle, processor, request, **kwargs):
    return oracle.encode_record(processor.tokenizer, copy.deepcopy(request), processor=processor, **kwargs)


def test_requests_cover_sizes_counts_and_states() -> None:
    assert len(REQUESTS) >= 20
    assert {len(r["images"]) for r in REQUESTS} == {1, 2, 3}
    assert any(isinstance(r["state"], dict) for r in REQUESTS) and any(isinstance(r["state"], str) for r in REQUESTS)
    assert any(not i.startswith("data:") for r in REQUESTS for i in r["images"])  # raw base64 too


@pytest.mark.parametrize("index", range(len(REQUESTS)))
def test_media_encoding_matches_reference(oracle, reference, vision_model, index) -> None:
    _, processor = reference
    request = REQUESTS[index]
    expected = _reference_encoded(oracle, processor, request)
    ours = vision_model.encode(request)
    assert ours.input_ids == expected.input_ids
    assert [(q.question_span, q.option_spans, q.option_ids) for q in ours.questions] == [
        (q.question_span, q.option_spans, q.option_ids) for q in expected.questions]
    media = ours.media
    assert media is not None and media.token_offset == expected.media["token_offset"]
    assert list(media.mm_token_type_ids) == expected.media["mm_token_type_ids"]
    assert media.visual_tokens == sum(1 for t in expected.media["mm_token_type_ids"] if t == 1) > 0
    np.testing.assert_array_equal(media.image_grid_thw, expected.media["image_grid_thw"].numpy())
    np.testing.assert_array_equal(media.pixel_values, expected.media["pixel_values"].numpy())


def test_probabilities_and_answers_match_reference(oracle, reference, vision_model) -> None:
    ref_model, processor = reference
    worst = 0.0
    predictions = vision_model.predict(REQUESTS)
    for request, prediction in zip(REQUESTS, predictions, strict=True):
        encoded = _reference_encoded(oracle, processor, request)
        [expected] = reference_probabilities(oracle, ref_model, processor, [encoded])
        for mine, theirs in zip(prediction.probabilities, expected, strict=True):
            worst = max(worst, float(np.abs(mine - theirs).max()))
        # the reference's own answer builder (what its systemone() returns) on its probabilities
        answers = {q.question_id: oracle.systemone_answer(request["questions"][q.question_id],
                                                          dict(zip(q.option_ids, p.tolist(), strict=True)))
                   for q, p in zip(encoded.questions, expected, strict=True)}
        assert round_floats(prediction.response("reference"))["answers"] == answers
    print(f"max |Δp| vs the reference over {len(REQUESTS)} image requests: {worst:.2e}")
    assert worst <= 1e-5, f"max |Δp| {worst:.2e} vs the reference"
    for request, prediction in list(zip(REQUESTS, predictions, strict=True))[:3]:  # end to end: its systemone()
        assert round_floats(prediction.response("reference")) == oracle.systemone(ref_model, processor,
                                                                                  copy.deepcopy(request))
    # the images matter: the same questions on other images give other numbers
    swapped = {**REQUESTS[0], "images": REQUESTS[3]["images"][:1]}
    assert float(np.abs(vision_model.predict([swapped])[0].probabilities[0] - predictions[0].probabilities[0]).max()) \
        > 1e-4


def test_mixed_batches_equal_one_by_one_and_the_reference_batch(oracle, reference, vision_model, monkeypatch) -> None:
    ref_model, processor = reference
    text_only = varied_requests(8, seed=3)[:5]
    mixed = [REQUESTS[0], text_only[0], REQUESTS[1], text_only[1], REQUESTS[4], text_only[2]]
    monkeypatch.setattr(vision_model, "pad_waste", float("inf"))  # one padded batch whatever the device allows
    together = vision_model.predict(mixed, batch_size=len(mixed))
    reference_batch = reference_probabilities(
        oracle, ref_model, processor, [_reference_encoded(oracle, processor, r) for r in mixed])
    for request, batched, theirs in zip(mixed, together, reference_batch, strict=True):
        alone = vision_model.predict([request])[0]
        assert alone.encoded.input_ids == batched.encoded.input_ids
        for a, b, c in zip(alone.probabilities, batched.probabilities, theirs, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
            np.testing.assert_allclose(b, c, atol=1e-5)


def test_text_with_a_vision_token_beside_an_image_request(vision_model, monkeypatch) -> None:
    """A text-only record whose state spells <|image_pad|> shares a batch with an image request: it runs through
    the text model on its own, with its one-by-one numbers."""
    odd = {"model": "m", "state": "the token <|image_pad|> as text", "questions": {"q": {"type": "noul"}}}
    monkeypatch.setattr(vision_model, "pad_waste", float("inf"))
    together = vision_model.predict([REQUESTS[2], odd], batch_size=2)
    for request, batched in zip([REQUESTS[2], odd], together, strict=True):
        alone = vision_model.predict([request])[0]
        for a, b in zip(alone.probabilities, batched.probabilities, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_assets_form_equals_the_reference_form(oracle, reference, vision_model) -> None:
    """Jev's assets: images in order of first appearance in the prompt, placeholders replaced by <image N>."""
    ref_model, processor = reference
    first, second = image(120, 80, seed=1), image(60, 200, seed=2, fmt="JPEG")
    jev = {"model": "m", "state": {"photo": "see ph-B and ph-A", "caption": "ph-B again"},
           "assets": {"ph-A": {"type": "image", "format": "png", "data_base64": base64.b64encode(first).decode()},
                      "ph-B": {"type": "image", "format": "jpg", "data_base64": base64.b64encode(second).decode()}},
           "questions": {"same": {"type": "noul", "instructions": "Is ph-A the same object as ph-B?"},
                         "which": {"type": "choice", "criteria": {"left": "like ph-A", "right": None}}}}
    # the state renders with sorted keys: "caption" (ph-B) comes before "photo"
    reference_form = {
        "model": "m", "images": [data_uri(second, "jpeg"), data_uri(first)],
        "state": {"photo": "see <image 1> and <image 2>", "caption": "<image 1> again"},
        "questions": {"same": {"type": "noul", "instructions": "Is <image 2> the same object as <image 1>?"},
                      "which": {"type": "choice", "criteria": {"left": "like <image 2>", "right": None}}}}
    from clef_local.runtime.schema import validate_request

    ours = vision_model.encode(jev)
    normal = validate_request(reference_form)
    assert ours.request.state == normal.state and ours.request.questions == normal.questions
    expected = _reference_encoded(oracle, processor, reference_form)
    assert ours.input_ids == expected.input_ids
    np.testing.assert_array_equal(ours.media.pixel_values, expected.media["pixel_values"].numpy())
    [theirs] = reference_probabilities(oracle, ref_model, processor, [expected])
    for mine, ref in zip(vision_model.predict([jev])[0].probabilities, theirs, strict=True):
        np.testing.assert_allclose(mine, ref, atol=1e-5)
    assert vision_model.decide(jev) == vision_model.decide(reference_form)


def test_python_inputs_equal_base64(vision_model) -> None:
    """PIL images, numpy arrays and bytes in ``images`` give the numbers of the same image as base64."""
    from PIL import Image

    data = image(150, 90, seed=7)
    pil = Image.open(__import__("io").BytesIO(data)).convert("RGB")
    base = {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}
    want = vision_model.predict([{**base, "images": [data_uri(data)]}])[0].probabilities[0]
    for form in (data, pil, np.asarray(pil)):
        got = vision_model.predict([{**base, "images": [form]}])[0].probabilities[0]
        np.testing.assert_array_equal(got, want)


def test_max_pixels_matches_the_reference_with_the_same_size(oracle, reference, tiny_vision) -> None:
    """MediaLimits(max_pixels=...) is the reference's processor call with a smaller size bound."""
    ref_model, processor = reference
    small = clef_local.load(tiny_vision, dtype="float32", media_limits=MediaLimits(max_pixels=100_000))
    request = {**REQUESTS[5], "images": [data_uri(image(1024, 768, seed=9))]}
    ours = small.encode(request)
    size = {"shortest_edge": 65536, "longest_edge": 100_000}
    expected = _reference_encoded(oracle, processor, {**request, "media_kwargs": {"size": size}})
    assert ours.input_ids == expected.input_ids
    assert ours.media.visual_tokens < 100_000 // (32 * 32) + 1  # ≤ max_pixels / (patch·merge)² tokens
    [theirs] = reference_probabilities(oracle, ref_model, processor, [expected])
    for mine, ref in zip(small.predict([request])[0].probabilities, theirs, strict=True):
        np.testing.assert_allclose(mine, ref, atol=1e-5)


# ---------------------------------------------------------------- video frames (torchvision)


def _torchvision_or_skip() -> None:
    from clef_local.runtime.processor import video_unavailable

    reason = video_unavailable()
    if reason:
        pytest.skip(reason)


def test_video_without_torchvision_is_refused_with_the_extra(vision_model) -> None:
    from clef_local.errors import ApiUsageError
    from clef_local.runtime.processor import video_unavailable

    if video_unavailable() is None:
        pytest.skip("torchvision works here: the video parity tests run instead")
    frames = [data_uri(image(64, 48, seed=s)) for s in range(4)]
    with pytest.raises(ApiUsageError, match=r"clef-local\[video\]"):
        vision_model.decide({"model": "m", "state": "s", "videos": [frames], "questions": {"q": {"type": "noul"}}})


def test_video_frames_match_reference(oracle, vision_model, tiny_vision) -> None:
    _torchvision_or_skip()
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vision)
    ref_model = reference_model(oracle, tiny_vision)
    worst = 0.0
    requests = []
    for i, (w, h, n) in enumerate([(64, 48, 4), (96, 160, 6), (200, 64, 9), (48, 48, 2)]):
        frames = [data_uri(image(w, h, seed=10 * i + s)) for s in range(n)]
        requests.append({"model": "m", "state": {"clip": i}, "videos": [frames],
                         "images": REQUESTS[i]["images"][:1] if i % 2 else [],
                         "questions": REQUESTS[i]["questions"]})
    from clef_local.runtime.media import decode_video

    for request in requests:
        # the reference takes the frames as images (its processor does not decode base64 video frames)
        ref_request = {**request, "videos": [decode_video(v, ("videos", 0)) for v in request["videos"]]}
        expected = _reference_encoded(oracle, processor, ref_request)
        ours = vision_model.encode(request)
        assert ours.input_ids == expected.input_ids
        assert list(ours.media.mm_token_type_ids) == expected.media["mm_token_type_ids"]
        np.testing.assert_array_equal(ours.media.pixel_values_videos, expected.media["pixel_values_videos"].numpy())
        [theirs] = reference_probabilities(oracle, ref_model, processor, [expected])
        for mine, ref in zip(vision_model.predict([request])[0].probabilities, theirs, strict=True):
            worst = max(worst, float(np.abs(mine - ref).max()))
    print(f"max |Δp| vs the reference over {len(requests)} video requests: {worst:.2e}")
    assert worst <= 1e-5
    with pytest.raises(RequestValidationError, match="a video needs at least 2 frames"):
        vision_model.encode({**requests[0], "videos": [requests[0]["videos"][0][:1]]})
    together = vision_model.predict([*requests, REQUESTS[0]], batch_size=8)
    for request, batched in zip([*requests, REQUESTS[0]], together, strict=True):
        for a, b in zip(vision_model.predict([request])[0].probabilities, batched.probabilities, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
