"""The models of a validation, loaded in turn: at most one at a time (the peak is the larger model, not the sum), and
the one loaded stays loaded while the next batch of probes needs only it (a variant compared with cached reference
answers loads once, however many looks the sequential verdict takes).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clef_local.formats.release import Release
    from clef_local.model import ClefModel, Prediction

log = logging.getLogger(__name__)

_COUNTERS = ("bytes_read", "group_loads", "read_seconds", "wait_seconds")  # running totals (backends.streaming)


@dataclass
class Usage:
    """How one model ran over a validation, summed over its batches of probes: what validation.json's ``runs``
    records (loads and their seconds, probes, compute seconds, and what a streamed model read)."""

    loads: int = 0
    load_seconds: float = 0.0
    requests: int = 0
    tokens: int = 0  # the probes' input tokens: with the parameters, the FLOPs a pass did
    batches: int = 0
    seconds: float = 0.0
    streamed: dict[str, Any] | None = None

    def add_streamed(self, now: Mapping[str, Any], before: Mapping[str, Any]) -> None:
        """Add what a streamed model read since ``before`` (its counters are per load; a validation may load it once
        per look): the counters summed, the rest (groups, layer bytes) as the model reports them."""
        total = dict(self.streamed or {})
        for key, value in now.items():
            if key in _COUNTERS and isinstance(value, int | float):
                total[key] = total.get(key, 0) + value - before.get(key, 0)
            else:
                total[key] = value
        self.streamed = total

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"loads": self.loads, "load_seconds": round(self.load_seconds, 2),
                               "requests": self.requests, "tokens": self.tokens,
                               "batches": self.batches, "seconds": round(self.seconds, 2)}
        if self.streamed is not None:
            out["streamed"] = self.streamed
        return out


@dataclass(frozen=True)
class Batch:
    """One model's predictions of a batch of probes, with the dtype and context it ran at."""

    predictions: list[Prediction]
    dtype: str
    context: int


@dataclass
class Turns:
    """Loads each model when its turn comes (``clef_local.load`` with ``offload="auto"``: resident when it fits,
    else streamed from disk under ``max_memory``), unloading the one before."""

    max_memory: str | None = None
    max_length: int | None = None
    batch_size: int = 8
    usage: dict[str, Usage] = field(default_factory=dict)
    _role: str | None = None
    _model: ClefModel | None = None
    _seen: dict[str, Any] = field(default_factory=dict)  # the loaded model's streamed counters at its last batch

    def predict(self, role: str, path: Path | Release, requests: Sequence[Mapping[str, Any]], *,
                dtype: str | None, truncate_state: bool = True) -> Batch:
        """``role``'s model (loaded from ``path`` unless it is the one loaded) on ``requests``."""
        import clef_local

        usage = self.usage.setdefault(role, Usage())
        if self._role != role:
            self.close()
            started = time.perf_counter()
            self._model = clef_local.load(path, dtype=dtype, max_memory=self.max_memory, offload="auto",
                                          max_length=self.max_length)
            self._role = role
            self._seen = {}
            usage.loads += 1
            usage.load_seconds += time.perf_counter() - started
        model = self._model
        if model is None:  # unreachable: set just above; keeps the type checker sure of it
            raise RuntimeError(f"no {role} model loaded")
        seconds: list[float] = []
        predictions = model.predict(list(requests), truncate_state=truncate_state, batch_size=self.batch_size,
                                    batch_seconds=seconds)
        usage.requests += len(requests)
        usage.tokens += sum(len(p.encoded.input_ids) for p in predictions)
        usage.batches += len(seconds)
        usage.seconds += sum(seconds)
        streamed = model.backend.describe().get("streamed")
        if streamed is not None:
            usage.add_streamed(streamed, self._seen)
            self._seen = dict(streamed)
            total = usage.streamed or {}
            log.info("%s streamed from disk: %.2f GB read in %d pass%s, %.1f s per pass (%.1f s reading)", role,
                     total.get("bytes_read", 0) / 1e9, usage.batches, "" if usage.batches == 1 else "es",
                     usage.seconds / max(usage.batches, 1), total.get("read_seconds", 0.0))
        decision = model.backend.load_decision
        return Batch(predictions, decision.dtype if decision else str(dtype), model.max_length)

    def close(self) -> None:
        """Unload the loaded model, if any (and collect, so its memory is back before the next one loads)."""
        if self._model is not None:
            self._model = None
            self._role = None
            gc.collect()
