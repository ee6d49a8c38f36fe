"""Images through ``clef-local serve`` on the tiny vision release: the official SDK's ``Image`` assets (multipart and
JSON) give the answers of ``decide`` with the reference form; every kind of bad media is a 4xx naming it, never a
5xx, and the server keeps answering (docs/serving.md, Media).

Run with ``-s`` to print the table of bad inputs (docs/benchmarks.md, Vision).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from media_gen import data_uri, image
from test_media import png_header_only

import clef_local
from clef_local.runtime.answers import round_floats
from clef_local.server.app import create_app
from clef_local.server.config import ServerConfig
from clef_local.server.run import ThreadedServer

PHOTO, SCAN = image(160, 120, seed=11), image(90, 240, seed=12, fmt="JPEG")
QUESTIONS = {
    "damaged": {"type": "noul", "instructions": "Is the product damaged?"},
    "kind": {"type": "choice", "instructions": "What is it?", "criteria": {"box": "A parcel", "mug": None}},
    "sharp": {"type": "score", "criteria": ["blurred", "fine", "sharp"]},
}


@pytest.fixture(scope="module")
def server(tiny_vision: Any, tiny_llama: Any) -> Iterator[ThreadedServer]:
    # max_length 16,384: a 4200×4000 image (~21K visual tokens) is over it, under the 65,536 default
    models = {"clef-vision": clef_local.load(tiny_vision, dtype="float32", max_length=16_384),
              "text-only": clef_local.load(tiny_llama, dtype="float32")}
    with ThreadedServer(create_app(models, ServerConfig())) as running:
        yield running


@pytest.fixture
def client(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _reference_form(model: Any, state: Any, images: list[bytes], questions: dict[str, Any]) -> dict[str, Any]:
    """What ``decide`` answers for the reference form of the same request (rounded as the wire rounds)."""
    request = {"model": "clef-vision", "state": state, "questions": questions,
               "images": [data_uri(i) for i in images]}
    return round_floats(model.decide(request), 4)["answers"]


def _sdk_answers(response: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for qid, answer in response.nouls.items():
        out[qid] = {"type": "noul", "noul": answer.noul}
    for qid, answer in response.choices.items():
        out[qid] = {"type": "choice", "choice": answer.choice, "confidence": answer.confidence,
                    "probabilities": dict(answer.probabilities)}
    for qid, answer in response.scores.items():
        out[qid] = {"type": "score", "score": answer.score, "confidence": answer.confidence,
                    "legend": {str(k): v for k, v in answer.legend.items()},
                    "probabilities": {str(k): v for k, v in answer.probabilities.items()}}
    return out


def test_sdk_images_multipart_and_json_equal_decide(server: ThreadedServer, vision_model: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import typesafe_sdk
    from typesafe_sdk import Choice, Image, Noul, Score

    photo, scan = Image(PHOTO), Image(SCAN)
    questions = {"damaged": Noul(instructions=f"Is the product in {photo} damaged?"),
                 "kind": Choice(instructions="What is it?", criteria={"box": f"A parcel like {scan}", "mug": None}),
                 "sharp": Score(criteria=["blurred", "fine", "sharp"])}
    plain = {"damaged": {"type": "noul", "instructions": "Is the product in <image 1> damaged?"},
             "kind": {"type": "choice", "instructions": "What is it?",
                      "criteria": {"box": "A parcel like <image 2>", "mug": None}},
             "sharp": QUESTIONS["sharp"]}
    state = {"photo": "<image 1>", "note": "returned"}
    # images in order of first appearance in the prompt: the photo (state), then the scan (a criterion)
    expected = _reference_form(vision_model, state, [PHOTO, SCAN], plain)
    assert expected != _reference_form(vision_model, state, [SCAN, PHOTO], plain)  # the order matters
    with typesafe_sdk.TypeSafeClient(api_key="any", base_url=server.url, timeout=120) as sdk:
        # the photo placed in the state and named in an instruction, the scan attached and named in a criterion:
        # a multipart body (request, asset-0, asset-1), zstd-compressed
        with sdk.attach_assets(scan):
            response = sdk.system_one(state={"photo": photo, "note": "returned"}, questions=questions,
                                      model="clef-vision")
        assert response.model == "clef-vision"
        assert _sdk_answers(response) == expected
        # the JSON form: assets with data_base64, sent through extra_body (the SDK then sends JSON, not multipart)
        assets = {"ph-photo": {"type": "image", "format": "png", "data_base64": base64.b64encode(PHOTO).decode()},
                  "ph-scan": {"type": "image", "format": "jpg", "data_base64": base64.b64encode(SCAN).decode()}}
        response = sdk.system_one(state={"photo": "ph-photo", "note": "returned"}, model="clef-vision",
                                  questions={"damaged": Noul(instructions="Is the product in ph-photo damaged?"),
                                             "kind": Choice(instructions="What is it?",
                                                            criteria={"box": "A parcel like ph-scan", "mug": None}),
                                             "sharp": Score(criteria=["blurred", "fine", "sharp"])},
                                  extra_body={"assets": assets})
        assert _sdk_answers(response) == expected
        # an Image only named inside a string, neither attached nor passed: the SDK sends its reference as text
        with pytest.raises(typesafe_sdk.TypeSafeError, match="no asset provides"):
            sdk.system_one(state=f"look at {Image(SCAN)}", questions={"q": Noul(instructions="ok?")},
                           model="clef-vision")


def test_raw_multipart_and_cloudflare_envelope(client: httpx.Client, vision_model: Any) -> None:
    # every occurrence of a placeholder is replaced ("ph" would also match inside "photo"): Jev recommends UUIDs
    request = {"model": "clef-vision", "state": "photo: 5f0c9d1e", "questions": QUESTIONS,
               "assets": {"5f0c9d1e": {"type": "image", "part": "img"}}}
    files = {"request": (None, json.dumps(request), "application/json"), "img": ("a.png", PHOTO, "image/png")}
    response = client.post("/v1/systemone", files=files)
    assert response.status_code == 200, response.text
    expected = _reference_form(vision_model, "photo: <image 1>", [PHOTO], QUESTIONS)
    assert response.json()["answers"] == expected
    assert response.json()["usage"]["input_tokens"] > 64  # at least one image's visual tokens
    wrapped = client.post("/accounts/a/ai/run/@cf/cloudflare/clef-vision", files=files)
    assert wrapped.status_code == 200 and wrapped.json()["result"]["answers"] == expected
    reference = client.post("/v1/systemone", json={"model": "clef-vision", "state": "photo: <image 1>",
                                                   "questions": QUESTIONS, "images": [data_uri(PHOTO)]})
    assert reference.status_code == 200 and reference.json()["answers"] == expected


def _multipart(request: Any, parts: dict[str, bytes], boundary: str = "b0undary") -> tuple[bytes, dict[str, str]]:
    chunks = []
    for name, content in [("request", json.dumps(request).encode()), *parts.items()]:
        chunks.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + content
                      + b"\r\n")
    return b"".join(chunks) + f"--{boundary}--\r\n".encode(), {
        "content-type": f"multipart/form-data; boundary={boundary}"}


def _tiff() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="TIFF")
    return buffer.getvalue()


def _big_solid_png(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _cases() -> list[tuple[str, dict[str, Any], int, str]]:
    """(kind, httpx.post keyword arguments, expected status, words of the message)."""
    base = {"model": "clef-vision", "state": "s", "questions": {"q": {"type": "noul"}}}

    def images(*values: Any, **extra: Any) -> dict[str, Any]:
        return {"json": {**base, "images": list(values), **extra}}

    def assets(state: str, entries: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"json": {**base, "state": state, "assets": entries, **extra}}

    body, headers = _multipart({**base, "state": "ph", "assets": {"ph": {"type": "image", "part": "p1"}}},
                               {"p0": PHOTO})
    unclaimed, unclaimed_headers = _multipart({**base, "state": "ph", "assets": {"ph": {"type": "image",
                                                                                       "part": "p0"}}},
                                              {"p0": PHOTO, "p9": PHOTO})
    no_request, no_request_headers = _multipart(base, {})
    no_request = no_request.replace(b'name="request"', b'name="body"')
    return [
        ("corrupt bytes (base64 of no image)", images(_b64(b"\x00\x01 not an image at all")), 422, "not an image"),
        ("truncated PNG", images(_b64(PHOTO[: len(PHOTO) // 2])), 422, "corrupt or truncated"),
        ("invalid base64", images("iVBORw0KGgo***"), 422, "not valid base64"),
        ("unknown format (TIFF)", images(_b64(_tiff())), 422, "TIFF images are not accepted"),
        ("non-image data URI", images("data:text/plain;base64,aGVsbG8="), 422, "type 'text/plain'"),
        ("decompression bomb (20000×20000 PNG header)", images(_b64(png_header_only(20000, 20000))), 422,
         "decompression bomb"),
        ("aspect ratio over 200 (600×2)", images(_b64(image(600, 2))), 422, "aspect ratio over 200"),
        ("URL (air-gapped)", images("https://example.com/cat.png"), 422, "does not fetch URLs"),
        ("local path", images("/home/user/cat.png"), 422, "paths are not read"),
        ("empty image string", images(""), 422, "empty"),
        ("an image that is a number", images(42), 422, "got int"),
        ("17 images (limit 16)", images(*[_b64(PHOTO)] * 17), 422, "more than the limit of 16"),
        ("video frames of two sizes", {"json": {**base, "videos": [[_b64(PHOTO), _b64(SCAN)]]}}, 422,
         "frames of a video must all have one size"),
        ("visual tokens over the context (4200×4000)", images(_b64(_big_solid_png(4200, 4000))), 413,
         "visual tokens"),
        ("the image pad token typed into the state", {"json": {**base, "state": "x <|image_pad|>",
                                                          "images": [_b64(PHOTO)]}}, 422,
         "vision placeholder tokens"),
        ("SDK reference without its asset", assets("ph <image:" + "0f" * 16 + ">",
                                                   {"ph": {"type": "image", "format": "png",
                                                           "data_base64": _b64(PHOTO)}}), 422,
         "no asset provides"),
        ("asset never referenced", assets("no placeholder", {"ph": {"type": "image", "format": "png",
                                                                    "data_base64": _b64(PHOTO)}}), 422,
         "never referenced"),
        ("asset with neither data nor part", assets("ph", {"ph": {"type": "image"}}), 422,
         "neither data_base64 nor part"),
        ("asset format not png/jpg/jpeg", assets("ph", {"ph": {"type": "image", "format": "gif",
                                                               "data_base64": _b64(PHOTO)}}), 422,
         "'gif' is not one of"),
        ("asset of type video", assets("ph", {"ph": {"type": "video", "data_base64": _b64(PHOTO)}}), 422,
         "only \"image\" assets"),
        ("asset naming a part in a JSON body", assets("ph", {"ph": {"type": "image", "part": "p0"}}), 422,
         "not multipart"),
        ("multipart: asset names a missing part", {"content": body, "headers": headers}, 422,
         "which the multipart body does not have"),
        ("multipart: a part no asset names", {"content": unclaimed, "headers": unclaimed_headers}, 422,
         "parts no asset names"),
        ("multipart: no request part", {"content": no_request, "headers": no_request_headers}, 422,
         "no part named 'request'"),
        ("multipart: no boundary", {"content": b"--x\r\n", "headers": {"content-type": "multipart/form-data"}},
         422, "boundary"),
        ("multipart/mixed", {"content": b"x", "headers": {"content-type": "multipart/mixed; boundary=x"}}, 415,
         "multipart/form-data"),
        ("box question", {"json": {**base, "images": [_b64(PHOTO)],
                                   "questions": {"dog": {"type": "box", "instructions": "the dog"}}}}, 422,
         "box questions"),
        ("image for a model without a vision tower", {"json": {**base, "model": "text-only",
                                                               "images": [_b64(PHOTO)]}}, 400,
         "has no vision tower"),
        ("body over 13 MiB", images(_b64(b"\0" * (10 * 1024 * 1024))), 413, "over the limit"),
    ]


CASES = _cases()


def test_bad_media_is_a_4xx_naming_it_and_the_server_stays_up(client: httpx.Client) -> None:
    rows = []
    for kind, kwargs, status, words in CASES:
        response = client.post("/v1/systemone", **kwargs)
        detail = response.json()["detail"]
        message = "; ".join(e["msg"] for e in detail) if isinstance(detail, list) else detail["message"]
        rows.append((kind, response.status_code, message))
        assert response.status_code == status, (kind, response.status_code, message)
        assert words in message, (kind, message)
    print(f"\n| bad input ({len(rows)} kinds) | status | message |\n|---|---|---|")
    for kind, status, message in rows:
        shown = message[:160].replace("|", "\\|") + ("…" if len(message) > 160 else "")
        print(f"| {kind} | {status} | {shown} |")
    assert len({kind for kind, _, _ in rows}) >= 12 and all(400 <= s < 500 for _, s, _ in rows)
    assert client.get("/health").json()["status"] == "ok"
    again = client.post("/v1/systemone", json={"model": "clef-vision", "state": "s", "images": [_b64(PHOTO)],
                                              "questions": QUESTIONS})
    assert again.status_code == 200 and set(again.json()["answers"]) == set(QUESTIONS)
    metrics = client.get("/metrics").text
    assert 'status="500"' not in metrics
