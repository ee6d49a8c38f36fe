"""What every backend offers :class:`clef_local.model.ClefModel`: the contract the loader builds against.

A backend runs the backbone over a right-padded batch of encoded records and the joint schema head over its hidden
states; ``ClefModel`` does everything else (encoding, batching, softmax, answers), so answers are built the same way
on every backend. Backends are constructed as ``cls(release, *, device=..., dtype=...)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from clef_local.formats.release import Release
    from clef_local.planning.choice import LoadDecision
    from clef_local.planning.prefill import PrefillBudget
    from clef_local.runtime.encoding import EncodedRecord
    from clef_local.runtime.layout import HeadLayout
    from clef_local.runtime.state_cache import StateCache


@runtime_checkable
class Backend(Protocol):
    """A loaded backbone + head on one device, and what it can do."""

    name: str  # "torch", "mlx", "onnx" or "llamacpp"
    release: Release
    device: Any  # the framework's own device object; str() names it ("cpu", "cuda:0", ...)
    load_decision: LoadDecision | None  # what the loader chose and why (set by build_backend)
    # how each prefill fits the memory left: chunk lengths, the 413 for a request that cannot fit (set by
    # build_backend; None: built without the loader, no check and one pass)
    prefill: PrefillBudget | None
    accepts_media: bool  # runs the vision tower (images and videos in the state, docs/format.md §7)
    # why this backend refuses images and videos, in its own words (None: accepts them, or ClefModel's generic line)
    media_refusal: str | None
    # why this backend cannot continue a pass from a cached state (None: it can; docs/serving.md#the-state-cache)
    state_cache_blocker: str | None
    # what makes two loaded models compute the same states: the state cache's key prefix, and the model part of
    # ClefModel.state_digest (runtime/state_cache.py model_identity)
    state_identity: str
    # a backend that wants other batches than its device's default (streamed from disk: a pass reads every layer once,
    # so as many padded tokens per batch as its activations allow, with more padding); None: ClefModel's defaults
    batch_tokens: int | None
    pad_waste: float | None

    def logits(self, records: Sequence[EncodedRecord], layout: HeadLayout, pad_token_id: int,
               cache: StateCache | None = None) -> np.ndarray:
        """Option logits ``[questions, max_options]`` (float32, ``-inf`` padding), the head included.

        ``cache``: take each record's state from it (run and stored on a miss) and run only the tokens after it;
        the same numbers within float noise. Only passed when :attr:`state_cache_blocker` is None.
        """
        ...

    def describe(self) -> dict[str, Any]:
        """Backend, device, dtypes, parameter counts and kernels, for ``clef-local inspect``."""
        ...
