"""What ``clef_local.load`` was asked for, as one typed object that the loader (:mod:`clef_local.backends.loader`)
and the planner (:mod:`clef_local.planning.choice`) read, instead of each taking the options one keyword at a time.
The meaning of each option: :func:`clef_local.load`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clef_local.runtime.answers import Confidence
from clef_local.runtime.media import DEFAULT_MEDIA_LIMITS, MediaLimits
from clef_local.runtime.schema import DEFAULT_LIMITS, Limits


@dataclass(frozen=True)
class LoadOptions:
    """``clef_local.load``'s options, sizes already parsed: ``state_cache`` in bytes (None: sized by the planner,
    0: off), ``state_cache_spill`` in bytes. ``check_memory=False`` plans without the memory check (tests, tools
    that only want the choice)."""

    device: str = "auto"
    dtype: Any = None  # a name ("bfloat16", "auto") or a torch.dtype; None: as stored
    backend: str = "auto"
    max_length: int | None = None
    confidence: Confidence = "jev"
    limits: Limits = DEFAULT_LIMITS
    max_memory: str | dict[str, Any] | None = None
    media_limits: MediaLimits = DEFAULT_MEDIA_LIMITS
    state_cache: int | None = None
    state_cache_spill: int = 0
    prefill_chunk: int | None = None
    offload: str = "none"
    check_memory: bool = True


DEFAULT_OPTIONS = LoadOptions()
