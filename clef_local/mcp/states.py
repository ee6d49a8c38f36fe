"""The states ``ask_again`` refers to: what each answered request's state was, kept by the server under the digest
its answer returned, so that an agent asks more about a state without sending it again.

The digest is :meth:`ClefModel.state_digest <clef_local.model.ClefModel.state_digest>`: SHA-256 of the model's
identity, the state's token ids and its media, so a digest can only name the same state of the same model (on the
torch backend it is also the state cache's key). What is kept is the request's state and media fields as they were
validated (text and base64, not decoded pixels), in an LRU bounded by their JSON size.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from clef_local.units import format_size

DEFAULT_BUDGET = 64 * 1024 * 1024  # bytes of states kept; a text state is a few KB, an image up to 13 MiB


@dataclass(frozen=True)
class SentState:
    """A state sent to ``model``: the request fields that make it up (``state``, ``images``, ``videos``,
    ``assets``, those present)."""

    model: str
    fields: dict[str, Any]
    nbytes: int


def sent_state(model: str, fields: dict[str, Any]) -> SentState:
    """A :class:`SentState` of ``fields`` (JSON values), sized by their JSON text."""
    size = len(json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))
    return SentState(model, fields, size)


class StateStore:
    """Digest → :class:`SentState`, least recently used first out, at most ``budget`` bytes (0: nothing kept, and
    ``ask_again`` always says the state is unknown). Thread-safe."""

    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        if budget < 0:
            raise ValueError(f"the state store's budget must be ≥ 0 bytes, got {budget}")
        self.budget = budget
        self._entries: OrderedDict[str, SentState] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0
        self.rejected = 0  # states larger than the whole budget, never kept

    def remember(self, digest: str, state: SentState) -> bool:
        """Keep ``state`` under ``digest`` (most recent); False when it is larger than the budget."""
        with self._lock:
            old = self._entries.pop(digest, None)
            if old is not None:
                self._bytes -= old.nbytes
            if state.nbytes > self.budget:
                self.rejected += 1
                return False
            while self._entries and self._bytes + state.nbytes > self.budget:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes
                self.evictions += 1
            self._entries[digest] = state
            self._bytes += state.nbytes
            return True

    def recall(self, digest: str) -> SentState | None:
        """The state of ``digest`` (now the most recent), or None."""
        with self._lock:
            state = self._entries.get(digest)
            if state is not None:
                self._entries.move_to_end(digest)
            return state

    def describe(self) -> dict[str, Any]:
        """Counts for the ``models`` tool."""
        with self._lock:
            return {"states": len(self._entries), "bytes": self._bytes, "budget": format_size(self.budget),
                    "evictions": self.evictions, "rejected": self.rejected}
