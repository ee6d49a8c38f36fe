"""What every backend offers :class:`clef_local.model.ClefModel`: the contract the loader builds against.

A backend runs the backbone over a right-padded batch of encoded records and the joint schema head over its hidden
states; ``ClefModel`` does everything else (validation, encoding, batching, softmax, answers), so answers are built
the same way on every backend. Backends are constructed as ``cls(release, *, device=..., dtype=...)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from clef_local.formats.release import Release
    from clef_local.planning.choice import LoadDecision
    from clef_local.runtime.encoding import EncodedRecord
    from clef_local.runtime.layout import HeadLayout
    from clef_local.runtime.state_cache import StateCache


@runtime_checkable
class Backend(Protocol):
    """A loaded backbone + head on one device."""

    name: str  # "torch", "mlx" or "onnx"
    release: Release
    device: Any  # the framework's own device object; str() names it ("cpu", "cuda:0", ...)
    load_decision: LoadDecision | None  # what the loader chose and why (set by build_backend)

    def logits(self, records: Sequence[EncodedRecord], layout: HeadLayout, pad_token_id: int,
               reach: int | None = None) -> np.ndarray:
        """Option logits ``[questions, max_options]`` (float32, ``-inf`` padding), the head included.

        ``reach``: run the backbone over the first ``reach`` positions only (the head reads no further,
        :mod:`clef_local.runtime.head_reach`); the later hidden states are zero.
        """
        ...

    def describe(self) -> dict[str, Any]:
        """Backend, device, dtypes, parameter counts and kernels, for ``clef-local inspect``."""
        ...


@runtime_checkable
class StateCachingBackend(Backend, Protocol):
    """A backend that can continue a backbone pass from a cached state (:mod:`clef_local.runtime.state_cache`):
    torch. MLX and ONNX Runtime do not implement it and always run every state (docs/serving.md)."""

    @property
    def state_cache_blocker(self) -> str | None:
        """Why this loaded backbone cannot use the cache after all (None: it can)."""
        ...

    def cached_logits(self, records: Sequence[EncodedRecord], layout: HeadLayout, pad_token_id: int,
                      cache: StateCache, reach: int | None = None) -> np.ndarray:
        """:meth:`Backend.logits` with each record's state from ``cache`` (stored there on a miss), running only the
        tokens after it; the same numbers within float noise."""
        ...
