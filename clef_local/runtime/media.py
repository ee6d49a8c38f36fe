"""Images and video frames in a request: the accepted forms, decoding under :class:`MediaLimits`, and
:func:`resolve_media`, the one entry point from a request's ``images`` / ``videos`` / ``assets`` to decoded images.

The forms, the limits and the errors (422 naming ``body.images.0``, ``body.assets.<placeholder>``, …):
docs/format.md §7. URLs are refused unless :attr:`MediaLimits.allow_urls`; paths are never read from a request.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clef_local.errors import ClefError, RequestValidationError
from clef_local.runtime.assets import invalid, map_assets
from clef_local.runtime.schema import LimitValidationError, SystemOneRequest

if TYPE_CHECKING:
    from PIL import Image

# What PIL must detect in the bytes; anything else (TIFF, ICO, PDF, SVG text, ...) is "an unknown format".
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_DATA_URI = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*?);base64,(?P<data>.*)", re.DOTALL)
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_PATH_HINT = re.compile(r"(^[~./\\]|[/\\]|\.(png|jpe?g|webp|gif|bmp|tiff?|heic|avif)$)", re.IGNORECASE)
Loc = tuple[Any, ...]


@dataclass(frozen=True)
class MediaLimits:
    """How much media one request may carry; ``clef_local.load(media_limits=...)``, ``serve`` / ``decide`` flags.

    The pixel budget of each image after resizing is the processor's (``preprocessor_config.json``:
    ``size.shortest_edge`` ≤ pixels ≤ ``size.longest_edge``, Qwen3.5 ships 65,536 and 16,777,216); ``max_pixels``
    lowers the upper bound (fewer visual tokens per image, different numbers than the release's default).
    """

    # One visual token costs a prompt position; 16 images of 1024×768 are 12,288 tokens of a 16,384 context.
    max_images: int = 16
    max_videos: int = 2
    # Frames per video, before the processor samples them (its fps rule keeps at most one in twelve of 24 fps).
    max_frames: int = 256
    # Width × height of one decoded image or frame: the decompression-bomb guard, checked from the header before
    # any pixel is decoded. PIL's own warning is at 89.5 M pixels; 50 M RGB pixels are 150 MB.
    max_input_pixels: int = 50_000_000
    # Lower the processor's largest resize target (pixels per image after resizing); None keeps the release's.
    max_pixels: int | None = None
    # Fetch http(s) URLs (``--allow-network``); off, a URL is a 422 naming it.
    allow_urls: bool = False
    url_timeout_s: float = 10.0
    max_url_bytes: int = 13 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("max_images", "max_videos", "max_frames", "max_input_pixels", "max_url_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"MediaLimits.{name} must be ≥ 0, got {getattr(self, name)}")
        if self.max_pixels is not None and self.max_pixels < 1:
            raise ValueError(f"MediaLimits.max_pixels must be positive or None, got {self.max_pixels}")


DEFAULT_MEDIA_LIMITS = MediaLimits()


@dataclass
class RequestMedia:
    """A request's media after :func:`resolve_media`: the request (placeholders replaced, no media fields), the
    decoded images in order after the prefix, and each video's frames."""

    request: SystemOneRequest
    images: list[Any] = field(default_factory=list)  # PIL images
    videos: list[list[Any]] = field(default_factory=list)  # frames (PIL images) per video

    def __bool__(self) -> bool:
        return bool(self.images or self.videos)


def _where(loc: Loc) -> str:
    head, *rest = loc
    return f"{head}[{']['.join(str(r) for r in rest)}]" if head != "assets" else f"asset {rest[0]!r}"


def _bad(loc: Loc, msg: str, error_type: str = "image_invalid") -> RequestValidationError:
    return invalid(list(loc), f"{_where(loc)}: {msg}", error_type)


def _limit(loc: Loc, msg: str, name: str) -> LimitValidationError:
    return LimitValidationError([{"loc": ["body", *loc], "msg": f"{msg}; configure MediaLimits({name}=...) "
                                  "(serve / decide flags) to allow more", "type": "too_long"}])


def _decode_base64(text: str, loc: Loc) -> bytes:
    compact = "".join(text.split())
    if not compact:
        raise _bad(loc, "the image is an empty string; send base64 image data or a data URI", "image_empty")
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _bad(loc, f"not valid base64 ({exc}); send the image file's bytes as base64 or a data URI",
                   "image_base64") from None


def _string_bytes(text: str, loc: Loc, limits: MediaLimits) -> bytes:
    """The image bytes a string stands for: a data URI, raw base64, or (with ``allow_urls``) an http(s) URL."""
    stripped = text.strip()
    match = _DATA_URI.fullmatch(stripped)
    if match:
        kind = match.group("type").lower()
        if kind and not kind.startswith("image/"):
            raise _bad(loc, f"the data URI is of type {kind!r}; send an image (data:image/png;base64,...)",
                       "image_format")
        return _decode_base64(match.group("data"), loc)
    if stripped.lower().startswith("data:"):
        raise _bad(loc, "a data URI must be base64 (data:image/png;base64,...)", "image_base64")
    if _URL.match(stripped):
        shown = stripped[:200]
        if not limits.allow_urls:
            raise _bad(loc, f"{shown!r} is a URL; clef-local does not fetch URLs (it runs air-gapped): send the "
                            "image bytes as base64, or start it with --allow-network to fetch http(s) URLs",
                       "image_url")
        return _fetch(stripped, loc, limits)
    try:
        return _decode_base64(stripped, loc)
    except RequestValidationError:
        if stripped and _PATH_HINT.search(stripped):
            raise _bad(loc, f"{stripped[:200]!r} looks like a file path; paths are not read from requests: send "
                            "the image bytes as base64 (the CLI reads local files: decide --image FILE)",
                       "image_path") from None
        raise


def _fetch(url: str, loc: Loc, limits: MediaLimits) -> bytes:
    """An http(s) URL's body, at most ``max_url_bytes``; any failure is a 422 naming the URL."""
    import urllib.error
    import urllib.request

    shown = url[:200]
    if not url.lower().startswith(("http://", "https://")):
        raise _bad(loc, f"{shown!r}: only http and https URLs are fetched", "image_url")
    try:
        with urllib.request.urlopen(url, timeout=limits.url_timeout_s) as response:
            data = response.read(limits.max_url_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError, ClefError) as exc:  # ClefError: the air gap
        raise _bad(loc, f"{shown!r} cannot be fetched ({exc})", "image_url") from None
    if len(data) > limits.max_url_bytes:
        raise _bad(loc, f"{shown!r} is over {limits.max_url_bytes} bytes", "image_too_large")
    return data


def _open_bytes(data: bytes, loc: Loc, limits: MediaLimits) -> Image.Image:
    """Decode image bytes as the reference's ``load_image`` does (EXIF orientation, RGB), under the limits."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not data:
        raise _bad(loc, "the image data is empty", "image_empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only
            if image.format not in IMAGE_FORMATS:
                raise _bad(loc, f"{image.format or 'this'} images are not accepted; send "
                                f"{', '.join(IMAGE_FORMATS)}", "image_format")
            _check_size(image.size, loc, limits)
            return ImageOps.exif_transpose(image).convert("RGB")
    except RequestValidationError:
        raise
    except UnidentifiedImageError:
        head = data[:8].hex(" ")
        raise _bad(loc, f"not an image in a format PIL reads (first bytes {head}); send "
                        f"{', '.join(IMAGE_FORMATS)}", "image_format") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _bad(loc, f"a decompression bomb ({exc})", "image_bomb") from None
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, IndexError, ... on hostile bytes
        raise _bad(loc, f"the image data is corrupt or truncated ({type(exc).__name__}: {exc})",
                   "image_corrupt") from None


def _check_size(size: tuple[int, int], loc: Loc, limits: MediaLimits) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise _bad(loc, f"the image is {width}×{height} pixels; it has no pixels", "image_size")
    if width * height > limits.max_input_pixels:
        raise _bad(loc, f"the image is {width}×{height} = {width * height:,} pixels, over the limit of "
                        f"{limits.max_input_pixels:,} (a decompression bomb guard; configure "
                        "MediaLimits(max_input_pixels=...))", "image_bomb")
    if max(width, height) / min(width, height) > 200:  # the processor's own limit (smart_resize)
        raise _bad(loc, f"the image is {width}×{height} pixels: an aspect ratio over 200 is not accepted by the "
                        "processor", "image_size")


def _from_array(array: Any, loc: Loc, limits: MediaLimits) -> Any:
    import numpy as np

    if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
        raise _bad(loc, f"a numpy image must be uint8 H×W, H×W×3 or H×W×4; got {array.dtype} {array.shape}",
                   "image_array")
    _check_size((array.shape[1], array.shape[0]), loc, limits)
    return array


def decode_image(value: Any, loc: Loc, limits: MediaLimits = DEFAULT_MEDIA_LIMITS) -> Any:
    """One image in any accepted form (module docstring) as the processor's input; ``loc`` names it in errors."""
    from PIL import Image

    if isinstance(value, Image.Image):
        _check_size(value.size, loc, limits)
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
        return _from_array(value, loc, limits)
    if isinstance(value, bytes | bytearray | memoryview):
        return _open_bytes(bytes(value), loc, limits)
    if isinstance(value, str):
        return _open_bytes(_string_bytes(value, loc, limits), loc, limits)
    raise _bad(loc, f"an image must be a base64 string or data URI (PIL images, numpy arrays and bytes from "
                    f"Python); got {type(value).__name__}", "image_type")


def decode_video(value: Any, loc: Loc, limits: MediaLimits = DEFAULT_MEDIA_LIMITS) -> list[Any]:
    """A video: a list of frames, each an image in any accepted form, all of one size."""
    if not isinstance(value, list | tuple) or isinstance(value, str):
        raise _bad(loc, f"a video must be a list of frames (images); got {type(value).__name__}", "video_type")
    if not value:
        raise _bad(loc, "a video needs at least one frame", "video_empty")
    if len(value) > limits.max_frames:
        raise _limit(loc, f"{_where(loc)}: the video has {len(value)} frames, more than the limit of "
                          f"{limits.max_frames}", "max_frames")
    frames = [decode_image(frame, (*loc, i), limits) for i, frame in enumerate(value)]
    sizes = {_size(f) for f in frames}
    if len(sizes) > 1:
        raise _bad(loc, f"the frames of a video must all have one size; got {sorted(sizes)}", "video_size")
    return frames


def _size(image: Any) -> tuple[int, int]:
    """(width, height) of a PIL image or a numpy array."""
    if hasattr(image, "getbands"):
        return int(image.size[0]), int(image.size[1])
    return int(image.shape[1]), int(image.shape[0])


def resolve_media(request: SystemOneRequest, *, limits: MediaLimits = DEFAULT_MEDIA_LIMITS,
                  parts: Mapping[str, bytes] | None = None) -> RequestMedia:
    """A request's media, decoded and checked: ``images`` first, then the ``assets`` in order of first appearance
    (their placeholders replaced by ``<image N>``, :mod:`clef_local.runtime.assets`), and ``videos``.

    ``parts`` are a multipart body's parts by name (``None``: the body was JSON).
    """
    images_in: Sequence[Any] = request.images or []
    videos_in: Sequence[Any] = request.videos or []
    base = request.model_copy(update={"images": None, "videos": None})
    mapped = None
    if request.assets is not None or parts:
        mapped = map_assets(base, request.assets, first_number=len(images_in) + 1, parts=parts)
        base = mapped.request
    count = len(images_in) + (len(mapped.images) if mapped else 0)
    if count > limits.max_images:
        raise _limit(("images",), f"the request carries {count} images, more than the limit of "
                                  f"{limits.max_images}", "max_images")
    if len(videos_in) > limits.max_videos:
        raise _limit(("videos",), f"the request carries {len(videos_in)} videos, more than the limit of "
                                  f"{limits.max_videos}", "max_videos")
    images = [decode_image(v, ("images", i), limits) for i, v in enumerate(images_in)]
    if mapped:
        images += [decode_image(a.data, a.loc, limits) for a in mapped.images]
    videos = [decode_video(v, ("videos", i), limits) for i, v in enumerate(videos_in)]
    return RequestMedia(base, images, videos)
