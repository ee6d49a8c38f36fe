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

    device: str = "auto"  # the planner picks CUDA, MPS or the CPU from what this machine has
    dtype: Any = None  # a name ("bfloat16", "auto") or a torch.dtype; None: as stored, as the release was trained
    backend: str = "auto"  # torch, MLX or ONNX Runtime, whichever runs this release best here
    max_length: int | None = None  # None: 65,536 or the backbone's context, whichever is smaller
    confidence: Confidence = "jev"  # the hosted API's definition, so answers match what clients already read
    limits: Limits = DEFAULT_LIMITS  # the hosted API's request limits
    max_memory: str | dict[str, Any] | None = None  # None: what each device has free
    media_limits: MediaLimits = DEFAULT_MEDIA_LIMITS
    state_cache: int | None = 0  # off: a one-shot request would pay for a state pass it never reuses
    state_cache_spill: int = 0  # entries pushed off an accelerator are dropped unless host memory is given
    prefill_chunk: int | None = None  # None: one pass unless the planner finds it does not fit
    offload: str = "none"  # streaming from disk is slow: only when asked ("disk") or allowed ("auto")
    check_memory: bool = True  # refuse before loading what does not fit

DEFAULT_OPTIONS = LoadOptions()
