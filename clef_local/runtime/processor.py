"""The release's image and video processors, and the placeholder ids a record's media put right after the prefix.

Images go through the processor ``AutoImageProcessor`` picks (the reference's choice in the same environment),
videos through Qwen3-VL's video processor (torchvision needed); both load on first use. The ids are the
reference's, built from the processor's grids (:class:`MediaProcessor`): docs/format.md §7.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from clef_local.errors import ApiUsageError, MaxTokensExceededError, ReleaseError
from clef_local.runtime.assets import invalid
from clef_local.runtime.encoding import MediaInputs, media_placeholder
from clef_local.runtime.media import DEFAULT_MEDIA_LIMITS, MediaLimits

log = logging.getLogger(__name__)

PREPROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"
VIDEO_PREPROCESSOR_CONFIG = "video_preprocessor_config.json"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
DEFAULT_VIDEO_FPS = 24  # what the reference's processor assumes for frames that carry no metadata
_PADS = re.compile(re.escape(IMAGE_PAD) + "|" + re.escape(VIDEO_PAD))
VIDEO_EXTRA = "pip install 'clef-local[video]' (torchvision built for this torch; docs/hardware.md)"


class PieceTokenizer(Protocol):
    def encode_pieces(self, pieces: Sequence[str]) -> list[list[int]]: ...

    def token_to_id(self, token: str) -> int | None: ...


@dataclass(frozen=True)
class ImageGeometry:
    """How the processor cuts an image: patches of ``patch`` pixels, ``merge``² patches per visual token, and the
    pixel range every image is resized into (Qwen3.5's releases: 16, 2, 65,536 to 16,777,216)."""

    patch: int = 16
    merge: int = 2
    temporal_patch: int = 2
    min_pixels: int = 65_536
    max_pixels: int = 16_777_216

    @classmethod
    def from_config(cls, config: dict[str, Any] | None = None) -> ImageGeometry:
        """Qwen3.5's pixel range with the patch sizes of ``config``'s ``vision_config`` (for a bare config.json)."""
        vision = (config or {}).get("vision_config") or {}
        return cls(patch=int(vision.get("patch_size", cls.patch)),
                   merge=int(vision.get("spatial_merge_size", cls.merge)),
                   temporal_patch=int(vision.get("temporal_patch_size", cls.temporal_patch)))

    @classmethod
    def from_release(cls, path: Path, config: dict[str, Any] | None = None) -> ImageGeometry:
        """From the release's ``preprocessor_config.json`` (:meth:`from_config` when there is none)."""
        file = Path(path) / PREPROCESSOR_CONFIG
        defaults = cls.from_config(config)
        if not file.is_file():
            return defaults
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ReleaseError(f"{file}: not readable JSON ({exc})") from exc
        size = data.get("size") or {}
        return cls(patch=int(data.get("patch_size", defaults.patch)), merge=int(data.get("merge_size", defaults.merge)),
                   temporal_patch=int(data.get("temporal_patch_size", defaults.temporal_patch)),
                   min_pixels=int(size.get("shortest_edge", data.get("min_pixels", cls.min_pixels))),
                   max_pixels=int(size.get("longest_edge", data.get("max_pixels", cls.max_pixels))))

    def resized(self, width: int, height: int, max_pixels: int | None = None) -> tuple[int, int]:
        """(width, height) the image is resized to: each side a multiple of ``patch·merge``, the area within the
        pixel range, the aspect ratio kept as closely as possible (Qwen-VL's ``smart_resize``)."""
        factor = self.patch * self.merge
        top = self.max_pixels if max_pixels is None else min(max_pixels, self.max_pixels)
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > top:
            beta = math.sqrt(height * width / top)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return w_bar, h_bar

    def image_tokens(self, width: int, height: int, max_pixels: int | None = None) -> int:
        """Visual tokens of one ``width × height`` image (the pad tokens the processor puts in the prompt)."""
        w, h = self.resized(width, height, max_pixels)
        return (w // self.patch) * (h // self.patch) // (self.merge * self.merge)


def video_unavailable() -> str | None:
    """Why videos cannot be processed here (torchvision missing or broken), or None when they can."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return f"videos need torchvision, which is not installed: {VIDEO_EXTRA}"
    except RuntimeError as exc:  # PyPI's torchvision beside the CPU torch wheel: "operator torchvision::nms ..."
        return f"videos need torchvision, which does not import beside this torch ({exc}): {VIDEO_EXTRA}"
    return None


class MediaProcessor:
    """A release's processors, loaded on first use, and :meth:`encode` (images, videos) → :class:`MediaInputs`."""

    def __init__(self, path: str | Path, config: dict[str, Any], tokenizer: PieceTokenizer,
                 limits: MediaLimits = DEFAULT_MEDIA_LIMITS) -> None:
        self.path = Path(path)
        self.config = config
        self.tokenizer = tokenizer
        self.limits = limits
        self.geometry = ImageGeometry.from_release(self.path, config)
        if limits.max_pixels is not None and limits.max_pixels < self.geometry.min_pixels:
            raise ValueError(f"MediaLimits.max_pixels={limits.max_pixels} is below the processor's minimum of "
                             f"{self.geometry.min_pixels} pixels per image")
        self._image_processor: Any = None
        self._video_processor: Any = None

    @property
    def loaded(self) -> bool:
        """Whether a processor has been loaded (a text-only request loads none)."""
        return self._image_processor is not None or self._video_processor is not None

    # ------------------------------------------------------------ the processors
    def _token_id(self, token: str, key: str) -> int:
        ours = self.tokenizer.token_to_id(token)
        declared = self.config.get(key)
        if ours is None or (declared is not None and ours != declared):
            raise ReleaseError(f"{self.path}: the tokenizer's {token} is {ours}, config.json's {key} is {declared}; "
                               "a release's vision tokens must agree")
        return ours

    @property
    def image_processor(self) -> Any:
        if self._image_processor is None:
            from transformers import AutoImageProcessor

            if not (self.path / PREPROCESSOR_CONFIG).is_file():
                raise ReleaseError(f"{self.path}: {PREPROCESSOR_CONFIG} is missing; a release that takes images "
                                   "ships its processor files")
            # transformers' own choice (torchvision's processor where it imports, else PIL's), as the reference's
            # AutoProcessor makes it; PIL's where torchvision is installed but broken (it would fail to import)
            backend = "pil" if video_unavailable() else None
            try:
                self._image_processor = AutoImageProcessor.from_pretrained(
                    self.path, backend=backend, local_files_only=True, trust_remote_code=False,
                    **self._processor_config())
            except (OSError, ValueError, TypeError, KeyError) as exc:
                raise ReleaseError(f"{self.path}: the image processor cannot be loaded ({exc})") from exc
            log.info("image processor %s from %s", type(self._image_processor).__name__, self.path)
        return self._image_processor

    def _processor_config(self) -> dict[str, Any]:
        """``{"processor_config": preprocessor_config.json}`` when ``processor_config.json`` nests an image processor
        transformers does not have, else nothing (transformers reads the nested one first). ``mlx_vlm.convert`` nests
        its own ``Qwen3VLImageProcessor`` there, with the geometry of the release's ``preprocessor_config.json``,
        which it copies unchanged: that file is the release's processor, and the one :class:`ImageGeometry` reads."""
        import transformers

        file = self.path / PROCESSOR_CONFIG
        try:
            nested = json.loads(file.read_text(encoding="utf-8")).get("image_processor") if file.is_file() else None
        except (OSError, ValueError) as exc:
            raise ReleaseError(f"{file}: not readable JSON ({exc})") from exc
        name = nested.get("image_processor_type") if isinstance(nested, dict) else None
        if not isinstance(name, str) or getattr(transformers, name, None) is not None:
            return {}
        try:
            config = json.loads((self.path / PREPROCESSOR_CONFIG).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ReleaseError(f"{self.path / PREPROCESSOR_CONFIG}: not readable JSON ({exc})") from exc
        log.info("%s nests the image processor %s, which transformers %s does not have (mlx-vlm writes its own "
                 "class there): reading %s's %s", file, name, transformers.__version__, PREPROCESSOR_CONFIG,
                 config.get("image_processor_type"))
        return {"processor_config": config}

    @property
    def video_processor(self) -> Any:
        if self._video_processor is None:
            reason = video_unavailable()
            if reason:
                raise ApiUsageError(reason)
            from transformers import AutoVideoProcessor

            try:
                self._video_processor = AutoVideoProcessor.from_pretrained(
                    self.path, local_files_only=True, trust_remote_code=False)
            except (OSError, ValueError, TypeError, KeyError, ImportError) as exc:
                raise ReleaseError(f"{self.path}: the video processor cannot be loaded ({exc})") from exc
        return self._video_processor

    # ------------------------------------------------------------ encoding
    def image_tokens(self, image: Any) -> int:
        """Visual tokens the processor will give a decoded image (PIL image or numpy array), from its size alone."""
        width, height = (image.size if hasattr(image, "getbands") else (image.shape[1], image.shape[0]))
        return self.geometry.image_tokens(width, height, self.limits.max_pixels)

    def encode(self, images: Sequence[Any], videos: Sequence[Sequence[Any]], *,
               max_tokens: int | None = None) -> MediaInputs:
        """The ids after the prefix and the vision tower's arrays for decoded ``images`` and ``videos``
        (:func:`clef_local.runtime.media.resolve_media`). Images whose visual tokens alone exceed ``max_tokens``
        are refused from their sizes, before any pixel is processed."""
        if not images and not videos:
            raise ValueError("encode needs at least one image or video")
        if max_tokens is not None and images:
            visual = sum(self.image_tokens(image) for image in images)
            if visual > max_tokens:
                raise MaxTokensExceededError(
                    f"the {len(images)} image{'s' * (len(images) != 1)} alone need {visual} visual tokens; the "
                    f"context is {max_tokens}: send fewer or smaller images (or lower --max-pixels)",
                    input_tokens=visual, max_tokens=max_tokens)
        out: dict[str, Any] = {}
        image_tokens: list[int] = []
        if images:
            kwargs: dict[str, Any] = {}
            if self.limits.max_pixels is not None:
                kwargs["size"] = {"shortest_edge": self.geometry.min_pixels,
                                  "longest_edge": min(self.limits.max_pixels, self.geometry.max_pixels)}
            try:
                processed = self.image_processor(images=list(images), return_tensors="np", **kwargs)
            except ValueError as exc:  # sizes are checked before; anything else the processor refuses is the input's
                raise invalid(["images"], f"the image processor refused the images ({exc})", "image_invalid") from None
            merge = int(self.image_processor.merge_size)
            out["pixel_values"] = np.ascontiguousarray(processed["pixel_values"], dtype=np.float32)
            out["image_grid_thw"] = np.asarray(processed["image_grid_thw"], dtype=np.int64)
            image_tokens = [int(np.prod(g)) // merge**2 for g in out["image_grid_thw"]]
        # the reference's text, each pad token replaced in one pass by its expansion (as the processor does)
        expansions = {IMAGE_PAD: iter([IMAGE_PAD * n for n in image_tokens]),
                      VIDEO_PAD: iter(self._videos(videos, out) if videos else [])}
        text = _PADS.sub(lambda m: next(expansions[m.group()]), media_placeholder(len(images), len(videos)))
        ids = self.tokenizer.encode_pieces([text])[0]
        image_id = self._token_id(IMAGE_PAD, "image_token_id")
        video_id = self._token_id(VIDEO_PAD, "video_token_id")
        types = tuple(1 if t == image_id else 2 if t == video_id else 0 for t in ids)
        return MediaInputs(tuple(ids), types, images=len(images), videos=len(videos), **out)

    def _videos(self, videos: Sequence[Sequence[Any]], out: dict[str, Any]) -> list[str]:
        """Run the video processor; fill ``out``'s video arrays; return each video's expansion of its pad token."""
        processor = self.video_processor
        for i, frames in enumerate(videos):
            if len(frames) < self.geometry.temporal_patch:  # the processor's temporal patches need this many frames
                raise invalid(["videos", i], f"videos[{i}]: a video needs at least {self.geometry.temporal_patch} "
                                             f"frames; got {len(frames)} (send a single frame as an image)",
                              "video_frames")
        try:
            processed = processor(videos=[list(v) for v in videos], return_metadata=True, return_tensors="np")
        except ValueError as exc:
            raise invalid(["videos"], f"the video processor refused the videos ({exc})", "video_invalid") from None
        out["pixel_values_videos"] = np.ascontiguousarray(np.asarray(processed["pixel_values_videos"]),
                                                          dtype=np.float32)
        grids = np.asarray(processed["video_grid_thw"], dtype=np.int64)
        out["video_grid_thw"] = grids
        merge = int(processor.merge_size)
        texts = []
        for grid, metadata in zip(grids, processed["video_metadata"], strict=True):
            fps = metadata.fps if metadata.fps is not None else DEFAULT_VIDEO_FPS
            times = _patch_times(list(metadata.frames_indices), fps, int(processor.temporal_patch_size))
            per_frame = int(grid[1] * grid[2]) // merge**2
            texts.append("".join(f"<{times[t]:.1f} seconds>{VISION_START}{VIDEO_PAD * per_frame}{VISION_END}"
                                 for t in range(int(grid[0]))))  # replaces the video's <|video_pad|>
        return texts


def _patch_times(indices: list[int], fps: float, temporal_patch: int) -> list[float]:
    """The mean time (seconds) of each temporal patch's frames; a last, short patch repeats its last frame."""
    if len(indices) % temporal_patch:
        indices = indices + [indices[-1]] * (temporal_patch - len(indices) % temporal_patch)
    times = [i / fps for i in indices]
    return [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]
