"""How one backbone pass fits the memory a loaded model leaves: the chunk length of each batch's prefill and the
413 for a request that cannot fit (docs/hardware.md#chunked-prefill). Pure arithmetic on
:mod:`clef_local.planning.estimate`'s formulas; the load's plan gives the room (``LoadDecision.activation_room``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clef_local.errors import ApiUsageError, RequestMemoryError
from clef_local.planning.estimate import PREFILL_STEP, ModelDims, activations, chunked_activations, fit_chunk
from clef_local.units import format_size

# the backends that run a prefill in chunks (the torch backend: clef_local.backends.torch_pass)
CHUNKED_PREFILL_BACKENDS = ("torch",)


@dataclass(frozen=True)
class PrefillBudget:
    """What one prefill may use where a model runs: ``room`` bytes of activations (None: no plan was made, so no
    check), whether the backend can ``chunk`` a pass, and ``forced_chunk``, a chunk length asked for
    (``load(prefill_chunk=…)``) instead of the planner's choice (0: never chunk)."""

    dims: ModelDims
    dtype: str
    room: int | None
    where: str  # the device, for messages
    chunking: bool
    forced_chunk: int | None = None

    def __post_init__(self) -> None:
        if self.forced_chunk is not None and (self.forced_chunk < 0 or self.forced_chunk % 64):
            raise ApiUsageError(f"prefill_chunk must be a positive multiple of 64 tokens (the gated delta rule's "
                                f"chunk) or 0 for one pass, got {self.forced_chunk}")
        if self.forced_chunk and not self.chunking:
            raise ApiUsageError(f"prefill_chunk={self.forced_chunk}: this backend runs every prefill in one pass; "
                                "chunked prefill runs on the torch backend (backend=\"torch\")")

    def chunk(self, tokens: int, rows: int = 1) -> int | None:
        """The chunk length of a prefill of ``rows`` × ``tokens`` (None: one pass): the forced one, else the
        planner's (:func:`~clef_local.planning.estimate.fit_chunk`) when the one pass does not fit the room (the
        shortest chunk when none fits: :meth:`check` refuses such a request before it runs)."""
        return self._plan(tokens, rows)[0]

    def need(self, tokens: int, rows: int = 1) -> int:
        """Activation bytes of that prefill as it will run (in :meth:`chunk`'s chunks)."""
        return self._plan(tokens, rows)[1]

    def _plan(self, tokens: int, rows: int) -> tuple[int | None, int]:
        if self.forced_chunk is not None:
            chunk = self.forced_chunk if 0 < self.forced_chunk < tokens else None
        elif self.room is None or not self.chunking:
            chunk = None
        else:
            fitted = fit_chunk(self.dims, tokens, rows, self.dtype, self.room)
            chunk = None if fitted is None else fitted or min(PREFILL_STEP, tokens)
        if chunk is None:
            return None, activations(self.dims, tokens, rows, self.dtype).total
        return chunk, chunked_activations(self.dims, tokens, rows, self.dtype, chunk).total

    def fits(self, tokens: int, rows: int = 1) -> bool:
        return self.room is None or self.need(tokens, rows) <= self.room

    def rows(self, tokens: int, limit: int) -> int:
        """How many records of ``tokens`` tokens one prefill may hold, at most ``limit``, at least 1."""
        if self.room is None:
            return limit
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(tokens, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def longest(self, limit: int) -> int:
        """The longest record (tokens, at most ``limit``) whose prefill fits alone; 0 when none does."""
        if self.fits(limit):
            return limit
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def check(self, tokens: int, context: int) -> None:
        """Raise :class:`~clef_local.errors.RequestMemoryError` (413) when a record of ``tokens`` tokens cannot run
        here alone; ``context`` (the model's) bounds the longest one named."""
        if self.fits(tokens):
            return
        chunk, need = self._plan(tokens, 1)
        room = self.room or 0
        longest = self.longest(min(tokens, context))
        how = "in one pass" if chunk is None else f"in chunks of {chunk:,} tokens"
        raise RequestMemoryError(
            f"the request has {tokens:,} tokens; their backbone pass needs {format_size(need)} of activations "
            f"{how}, and {format_size(room)} are left on {self.where} after the weights, the runtime and the state "
            f"cache: the longest request that fits here is {longest:,} tokens; send a shorter state, or load the model "
            "with more memory (--max-memory), a smaller variant or no state cache",
            input_tokens=tokens, max_tokens=longest, need_bytes=need, budget_bytes=room)

    def describe(self, context: int) -> dict[str, Any]:
        """What ``clef-local inspect`` shows: the room, and how a request of ``context`` tokens runs."""
        return {"activation_room_bytes": self.room, "chunked_prefill": self.chunking,
                "forced_chunk": self.forced_chunk, "chunk_at_context": self.chunk(context),
                "longest_request": self.longest(context)}


def prefill_budget(decision: Any, config: Mapping[str, Any], head_width: int,
                   forced_chunk: int | None = None) -> PrefillBudget:
    """The budget of a model loaded as ``decision`` (a :class:`~clef_local.planning.choice.LoadDecision`): its
    ``activation_room`` (None when no plan was made), dtype, device and backend; ``config``: the release's."""
    dims = ModelDims.from_config(config, head_width=head_width)
    # a streamed pass runs each decoder layer over the whole batch (layer-major): it cannot be cut into chunks
    chunking = decision.backend in CHUNKED_PREFILL_BACKENDS and getattr(decision, "stream", None) is None
    return PrefillBudget(dims=dims, dtype=decision.dtype, room=decision.activation_room, where=decision.device,
                         chunking=chunking, forced_chunk=forced_chunk)
