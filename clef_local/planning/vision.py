"""What images add to a plan (``clef-local plan --image-size 1024x768 --images 2``): each image's visual tokens, as
the processor counts them (:class:`clef_local.runtime.processor.ImageGeometry`), and the vision tower's peak over the
patches, freed before the text layers run. The formula: docs/hardware.md#the-memory-formula.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clef_local.runtime.processor import ImageGeometry

_SIZE = re.compile(r"\s*(\d+)\s*[x×X]\s*(\d+)\s*")


def parse_image_size(text: str) -> tuple[int, int]:
    """``"1024x768"`` → (1024, 768) (width × height)."""
    match = _SIZE.fullmatch(text)
    if not match or min(int(match.group(1)), int(match.group(2))) < 1:
        raise ValueError(f"--image-size {text!r}: expected WIDTHxHEIGHT in pixels, e.g. 1024x768")
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class VisionDims:
    """The vision tower's shapes (``vision_config``)."""

    hidden: int
    intermediate: int
    heads: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VisionDims | None:
        vision = config.get("vision_config")
        if not isinstance(vision, Mapping):
            return None
        return cls(hidden=int(vision["hidden_size"]), intermediate=int(vision["intermediate_size"]),
                   heads=int(vision.get("num_heads", 1)))


@dataclass(frozen=True)
class ImageLoad:
    """Images per record and their size, as the plan counts them."""

    width: int
    height: int
    images: int
    tokens_per_image: int
    patches_per_image: int

    @property
    def visual_tokens(self) -> int:
        return self.images * self.tokens_per_image

    def to_json(self) -> dict[str, Any]:
        return {"image_size": [self.width, self.height], "images": self.images,
                "visual_tokens_per_image": self.tokens_per_image, "visual_tokens": self.visual_tokens}


def image_load(geometry: ImageGeometry, width: int, height: int, images: int) -> ImageLoad:
    if images < 1:
        raise ValueError(f"--images must be at least 1, got {images}")
    tokens = geometry.image_tokens(width, height)
    return ImageLoad(width, height, images, tokens, tokens * geometry.merge * geometry.merge)


def vision_activation_bytes(dims: VisionDims, load: ImageLoad, batch: int, dtype_size: int) -> int:
    """Peak bytes of the vision tower over ``batch`` records' images (formula: module docstring)."""
    patches = load.patches_per_image * load.images * batch
    per_patch = dtype_size * (4 * dims.hidden + max(2 * dims.intermediate, 4 * dims.hidden))
    return patches * per_patch + dims.heads * load.patches_per_image ** 2 * dtype_size
