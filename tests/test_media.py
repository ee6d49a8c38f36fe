"""Media in requests without a model: decoding under limits (clef_local.runtime.media), Jev's assets mapped onto the
reference form (clef_local.runtime.assets), the processor's geometry (clef_local.runtime.processor)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from media_gen import data_uri, image

from clef_local.errors import RequestValidationError
from clef_local.runtime.assets import map_assets
from clef_local.runtime.media import MediaLimits, decode_image, decode_video, resolve_media
from clef_local.runtime.processor import ImageGeometry
from clef_local.runtime.schema import LimitValidationError, SystemOneRequest, validate_request

PNG = image(40, 30, seed=1)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width × height`` and holds one compressed row: a decompression bomb's header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND",
                                                                                                           b"")


def _error(call, *args, **kwargs) -> dict:
    with pytest.raises(RequestValidationError) as info:
        call(*args, **kwargs)
    [error] = info.value.errors
    return error


def test_every_form_decodes_to_the_same_pixels() -> None:
    want = np.asarray(decode_image(data_uri(PNG), ("images", 0)))
    assert want.shape == (30, 40, 3)
    text = base64.b64encode(PNG).decode()
    wrapped = "data:image/png;base64," + "\n".join(text[i:i + 76] for i in range(0, len(text), 76))
    for form in (text, PNG, bytearray(PNG), memoryview(PNG), wrapped):
        np.testing.assert_array_equal(np.asarray(decode_image(form, ("images", 0))), want)
    from PIL import Image

    pil = Image.open(io.BytesIO(PNG))
    assert decode_image(pil, ("images", 0)) is pil  # PIL images and arrays go on as they are (as the reference)
    array = np.zeros((5, 7, 3), np.uint8)
    assert decode_image(array, ("images", 0)) is array


def test_exif_orientation_is_applied_like_the_reference() -> None:
    from PIL import Image
    from transformers.image_utils import load_image

    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    buffer = io.BytesIO()
    Image.fromarray(np.arange(6 * 4 * 3, dtype=np.uint8).reshape(6, 4, 3)).save(buffer, format="JPEG", exif=exif)
    text = data_uri(buffer.getvalue(), "jpeg")
    ours = np.asarray(decode_image(text, ("images", 0)))
    assert ours.shape == (4, 6, 3)
    np.testing.assert_array_equal(ours, np.asarray(load_image(text)))


@pytest.mark.parametrize(("value", "error_type", "words"), [
    (base64.b64encode(b"\x00garbage bytes that are no image").decode(), "image_format", "not an image"),
    (base64.b64encode(PNG[: len(PNG) // 2]).decode(), "image_corrupt", "corrupt or truncated"),
    ("not base64 at all!!", "image_base64", "not valid base64"),
    ("", "image_empty", "empty"),
    ("https://example.com/cat.png", "image_url", "does not fetch URLs"),
    ("ftp://example.com/cat.png", "image_url", "does not fetch URLs"),
    ("/etc/passwd", "image_path", "paths are not read"),
    ("photos/cat.png", "image_path", "paths are not read"),
    ("data:text/plain;base64,aGVsbG8=", "image_format", "type 'text/plain'"),
    ("data:image/png,rawbytes", "image_base64", "must be base64"),
    (12, "image_type", "got int"),
    ({"url": "x"}, "image_type", "got dict"),
    (np.zeros((4, 4), np.float32), "image_array", "uint8"),
    (base64.b64encode(png_header_only(20_000, 20_000)).decode(), "image_bomb", "decompression bomb"),
    (base64.b64encode(image(600, 2, seed=3)).decode(), "image_size", "aspect ratio over 200"),
])
def test_bad_images_name_the_image(value, error_type: str, words: str) -> None:
    error = _error(decode_image, value, ("images", 2))
    assert error["loc"] == ["body", "images", 2] and error["type"] == error_type
    assert error["msg"].startswith("images[2]: ") and words in error["msg"], error["msg"]


def test_unknown_formats_are_refused() -> None:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="TIFF")
    error = _error(decode_image, buffer.getvalue(), ("assets", "ph"))
    assert error["type"] == "image_format" and "TIFF images are not accepted" in error["msg"]
    assert error["msg"].startswith("asset 'ph': ")


def test_pil_decompression_bomb_limit_is_ours() -> None:
    bomb = png_header_only(9000, 9000)  # 81 M pixels: under PIL's own error, over a lowered limit
    error = _error(decode_image, bomb, ("images", 0), MediaLimits(max_input_pixels=10_000_000))
    assert error["type"] == "image_bomb" and "9000×9000" in error["msg"] and "max_input_pixels" in error["msg"]


def test_urls_are_fetched_only_when_allowed(tmp_path) -> None:
    import http.server
    import threading

    (tmp_path / "cat.png").write_bytes(PNG)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             lambda *a: Quiet(*a, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/cat.png"
        assert _error(decode_image, url, ("images", 0))["type"] == "image_url"
        fetched = decode_image(url, ("images", 0), MediaLimits(allow_urls=True))
        np.testing.assert_array_equal(np.asarray(fetched), np.asarray(decode_image(PNG, ("images", 0))))
        missing = _error(decode_image, url.replace("cat", "dog"), ("images", 0), MediaLimits(allow_urls=True))
        assert "cannot be fetched" in missing["msg"] and "404" in missing["msg"]
        small = _error(decode_image, url, ("images", 0), MediaLimits(allow_urls=True, max_url_bytes=100))
        assert small["type"] == "image_too_large"
    finally:
        server.shutdown()


def test_videos_are_lists_of_equal_frames() -> None:
    frames = decode_video([data_uri(image(32, 24, seed=s)) for s in range(3)], ("videos", 0))
    assert [f.size for f in frames] == [(32, 24)] * 3
    assert _error(decode_video, "frame.png", ("videos", 0))["type"] == "video_type"
    assert _error(decode_video, [], ("videos", 0))["type"] == "video_empty"
    mixed = _error(decode_video, [PNG, image(41, 30)], ("videos", 1))
    assert mixed["type"] == "video_size" and mixed["loc"] == ["body", "videos", 1]
    frame = _error(decode_video, [PNG, "zzz!"], ("videos", 0))
    assert frame["loc"] == ["body", "videos", 0, 1] and frame["msg"].startswith("videos[0][1]: ")
    with pytest.raises(LimitValidationError, match="max_frames"):
        decode_video([PNG] * 5, ("videos", 0), MediaLimits(max_frames=4))


# ---------------------------------------------------------------- Jev assets


def _record(request: dict) -> SystemOneRequest:
    return validate_request({"model": "m", **request})


def _asset(data: bytes = PNG, fmt: str = "png") -> dict:
    return {"type": "image", "format": fmt, "data_base64": base64.b64encode(data).decode()}


def test_assets_follow_the_prompt_order_and_become_markers() -> None:
    record = _record({
        "state": {"z": "last ph-1", "a": ["ph-2 first", {"k": "ph-2 twice"}]},
        "questions": {
            "q": {"type": "choice", "instructions": "compare ph-3 with ph-1",
                  "criteria": {"b": "ph-4 here", "a": "ph-5 here (a sorts first)"}},
            "s": {"type": "score", "criteria": ["ph-6", {"level": "ph-7"}]},
            "n": {"type": "noul", "criteria": {"false": "ph-8", "true": "ph-9 (true comes first)"}}}})
    assets = {f"ph-{i}": _asset() for i in range(1, 10)}
    mapped = map_assets(record, assets, first_number=3)
    assert [a.name for a in mapped.images] == ["ph-2", "ph-1", "ph-3", "ph-5", "ph-4", "ph-6", "ph-7", "ph-9", "ph-8"]
    out = mapped.request.model_dump()
    assert out["state"] == {"z": "last <image 4>", "a": ["<image 3> first", {"k": "<image 3> twice"}]}
    assert out["questions"]["q"]["instructions"] == "compare <image 5> with <image 4>"
    assert out["questions"]["q"]["criteria"] == {"b": "<image 7> here", "a": "<image 6> here (a sorts first)"}
    assert out["questions"]["s"]["criteria"] == ["<image 8>", {"level": "<image 9>"}]
    assert out["questions"]["n"]["criteria"] == {"false": "<image 11>", "true": "<image 10> (true comes first)"}
    assert record.state["z"] == "last ph-1"  # type: ignore[index]  # the input is not modified


def test_longest_placeholder_wins() -> None:
    record = _record({"state": "img10 then img1", "questions": {"q": {"type": "noul"}}})
    mapped = map_assets(record, {"img1": _asset(), "img10": _asset()})
    assert mapped.request.state == "<image 1> then <image 2>"
    assert [a.name for a in mapped.images] == ["img10", "img1"]


@pytest.mark.parametrize(("assets", "state", "loc", "error_type", "words"), [
    ({"ph": _asset()}, "no placeholder here", ["assets", "ph"], "asset_unreferenced", "never referenced"),
    ({"ph": _asset()}, "ph and <image:" + "ab" * 16 + ">", ["assets"], "asset_missing", "no asset provides"),
    ({}, "s", ["assets"], "asset_invalid", "must not be empty"),
    ([1], "s", ["assets"], "asset_invalid", "must be an object"),
    ({"ph": "data"}, "ph", ["assets", "ph"], "asset_invalid", "must be an object"),
    ({"ph": {"type": "video", "data_base64": "AA"}}, "ph", ["assets", "ph", "type"], "asset_type", "only \"image\""),
    ({"ph": {"type": "image"}}, "ph", ["assets", "ph"], "asset_missing_data", "neither data_base64 nor part"),
    ({"ph": {"type": "image", "data_base64": "AA"}}, "ph", ["assets", "ph", "format"], "asset_format", "required"),
    ({"ph": _asset(fmt="gif")}, "ph", ["assets", "ph", "format"], "asset_format", "'gif' is not one of"),
    ({"ph": {"type": "image", "part": "asset-0"}}, "ph", ["assets", "ph", "part"], "asset_part", "not multipart"),
    ({" ": _asset()}, "s", ["assets"], "asset_invalid", "non-empty strings"),
])
def test_bad_assets_name_the_asset(assets, state: str, loc: list, error_type: str, words: str) -> None:
    error = _error(map_assets, _record({"state": state, "questions": {"q": {"type": "noul"}}}), assets)
    assert error["loc"] == ["body", *loc] and error["type"] == error_type and words in error["msg"], error


def test_multipart_parts_are_claimed_once() -> None:
    record = _record({"state": "a b", "questions": {"q": {"type": "noul"}}})
    mapped = map_assets(record, {"a": {"type": "image", "part": "p0"}, "b": {"type": "image", "part": "p1"}},
                        parts={"p0": b"zero", "p1": b"one"})
    assert [(a.name, a.data) for a in mapped.images] == [("a", b"zero"), ("b", b"one")]
    missing = _error(map_assets, record, {"a": {"type": "image", "part": "p9"}, "b": _asset()}, parts={})
    assert missing["type"] == "asset_part" and "'p9'" in missing["msg"]
    twice = _error(map_assets, record, {"a": {"type": "image", "part": "p0"}, "b": {"type": "image", "part": "p0"}},
                   parts={"p0": b"x"})
    assert "both name the part" in twice["msg"]
    extra = _error(map_assets, record, {"a": {"type": "image", "part": "p0"}, "b": _asset()},
                   parts={"p0": b"x", "p1": b"y"})
    assert "no asset names: p1" in extra["msg"]


def test_resolve_media_orders_images_then_assets_and_checks_counts() -> None:
    other = image(20, 20, seed=5)
    record = _record({"state": "see ph", "images": [data_uri(other)], "questions": {"q": {"type": "noul"}},
                      "assets": {"ph": _asset()}})
    media = resolve_media(record)
    assert media.request.state == "see <image 2>"
    assert (media.request.images, media.request.videos, media.request.assets) == (None, None, None)
    assert [im.size for im in media.images] == [(20, 20), (40, 30)]
    with pytest.raises(LimitValidationError, match="2 images, more than the limit of 1"):
        resolve_media(record, limits=MediaLimits(max_images=1))
    with pytest.raises(LimitValidationError, match="max_videos"):
        resolve_media(_record({"state": "s", "videos": [[PNG]] * 3, "questions": {"q": {"type": "noul"}}}))


def test_box_questions_say_clef_has_none() -> None:
    with pytest.raises(RequestValidationError, match=r"box questions .* not supported: Clef answers noul, choice"):
        validate_request({"model": "m", "state": "s", "questions": {"dog": {"type": "box", "instructions": "x"}}})


@pytest.mark.parametrize(("size", "tokens"), [((64, 64), 64), ((1024, 768), 768), ((8000, 8000), 16384)])
def test_geometry_counts_visual_tokens(size: tuple[int, int], tokens: int) -> None:
    assert ImageGeometry().image_tokens(*size) == tokens


def test_geometry_equals_the_processor(tiny_vision) -> None:
    """The token count from an image's size alone (the planner's, the context check's) is the processor's."""
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(tiny_vision, backend="pil")
    geometry = ImageGeometry.from_release(tiny_vision)
    sizes = [(17, 23), (33, 500), (64, 64), (257, 129), (300, 220), (640, 480), (1000, 7), (1920, 1080),
             (3000, 2000), (255, 257)]
    for width, height in sizes:
        for bound in (None, 100_000):
            kwargs = {} if bound is None else {"size": {"shortest_edge": 65536, "longest_edge": bound}}
            grid = processor(images=[Image.new("RGB", (width, height))], return_tensors="np", **kwargs)
            actual = int(np.prod(grid["image_grid_thw"][0])) // 4
            assert geometry.image_tokens(width, height, bound) == actual, (width, height, bound)


def _mutated(data: bytes, positions: list[int], values: list[int]) -> bytes:
    out = bytearray(data)
    for position, value in zip(positions, values, strict=False):
        out[position % len(out)] = value
    return bytes(out)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP"])
def test_hostile_bytes_are_a_422_or_an_image(fmt: str) -> None:
    """Random and mutated image files never raise anything but a RequestValidationError naming the image."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    original = image(48, 32, seed=4, fmt=fmt)

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(st.one_of(st.binary(max_size=400),
                     st.builds(_mutated, st.just(original), st.lists(st.integers(0, 10**6), max_size=8),
                               st.lists(st.integers(0, 255), max_size=8)),
                     st.integers(1, len(original)).map(lambda n: original[:n])))
    def check(data: bytes) -> None:
        try:
            decoded = decode_image(data, ("images", 5))
        except RequestValidationError as exc:
            assert exc.errors[0]["loc"] == ["body", "images", 5] and exc.errors[0]["msg"].startswith("images[5]: ")
        else:
            assert decoded.mode == "RGB" and decoded.size[0] * decoded.size[1] > 0

    check()
