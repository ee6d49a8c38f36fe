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
