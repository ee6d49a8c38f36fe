"""An exact cache of the backbone's work on a state, so a second schema on the same state costs only its own tokens.

Backend-free: the key (:func:`state_key`, :func:`record_state_key`, :func:`model_identity`: token ids, never text),
size parsing and the LRU by exact bytes, thread-safe, with an optional host-memory spill. Entries are opaque
(:class:`CachedState`): the backend counts their bytes and moves them. Why it is exact and how it is bounded:
docs/serving.md#the-state-cache.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from clef_local import units

if TYPE_CHECKING:
    from clef_local.runtime.encoding import EncodedRecord

log = logging.getLogger(__name__)

def parse_size(value: str | int | None) -> int | None:
    """A cache size as bytes (:func:`clef_local.units.parse_size`: ``"512MiB"``, ``"2GiB"``, ``"1.5GB"``, ``0`` for
    off); ``None``/``"auto"`` is ``None`` (the planner sizes it)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    return units.parse_size(value, what="the state cache size")


def model_identity(path: Path, weight_files: Iterable[Path], *, backend: str, device: str, dtype: str) -> str:
    """What makes two loaded models compute the same states: the release (its configs' bytes, its weight files'
    names, sizes and modification times), the backend, the device and the compute dtype. A quantized variant differs
    from its source by its config and weights, so it never shares a key with it."""
    digest = hashlib.sha256()
    path = Path(path).resolve()
    digest.update(str(path).encode())
    for name in ("config.json", "joint_head_config.json"):
        file = path / name
        digest.update(file.read_bytes() if file.is_file() else b"-")
    for file in sorted(Path(f) for f in weight_files):
        stat = file.stat()
        digest.update(f"\0{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    digest.update(f"\0{backend}\0{device}\0{dtype}".encode())
    return digest.hexdigest()


def state_key(identity: str, token_ids: Sequence[int], media: bytes = b"") -> str:
    """The cache key of a state: SHA-256 of the model identity, the token ids of prefix + media + state (int64,
    little-endian) and ``media``, the digest of the request's pixel tensors (empty without media)."""
    digest = hashlib.sha256(identity.encode())
    digest.update(len(token_ids).to_bytes(8, "little"))
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    digest.update(len(media).to_bytes(8, "little"))
    digest.update(media)
    return digest.hexdigest()


def state_end(record: EncodedRecord) -> int:
    """Positions of prefix + media + state: where a record's schema starts."""
    return record.state_start + record.state_tokens


def record_state_key(identity: str, record: EncodedRecord) -> str:
    """The cache key of a record's state: its ids up to :func:`state_end` and, with media, the media's digest
    (:attr:`MediaInputs.digest <clef_local.runtime.encoding.MediaInputs.digest>`: ids, modalities and every pixel
    array's dtype, shape and bytes), so two pictures behind the same placeholder ids never share an entry. A
    text-only record keys on its ids alone, even one that spells a vision pad token as text."""
    media = b"" if record.media is None else bytes.fromhex(record.media.digest)
    return state_key(identity, record.input_ids[: state_end(record)], media=media)


class CachedState(Protocol):
    """What a backend stores: its exact size and how to move it between the device and host memory."""

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the entry holds (exact: the tensors are compact)."""
        ...

    def to_host(self) -> CachedState:
        """The same entry in host memory (``self`` when it already is)."""
        ...

    def to_device(self) -> CachedState:
        """The same entry on the compute device (``self`` when it already is)."""
        ...


@dataclass(frozen=True)
class CacheStats:
    """Counters since the cache was made, and its contents now."""

    hits: int  # records that ran only their schema tokens (their state came from the cache or from a batch mate)
    misses: int  # state passes run (a record whose state was not cached)
    stores: int  # entries stored
    evictions: int  # entries dropped to stay within a budget
    spills: int  # entries moved from the device to host memory
    rejected: int  # entries larger than the budget, never stored
    memory_clears: int  # times the cache was emptied because a pass ran out of memory
    entries: int
    bytes: int  # on the device
    budget: int
    host_entries: int
    host_bytes: int
    host_budget: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class StateCache:
    """LRU of :class:`CachedState` entries by exact bytes: ``budget`` on the device, ``spill`` in host memory.

    ``budget == 0`` turns the cache off (:attr:`enabled` is False; nothing is stored).
    """

    def __init__(self, budget: int, *, spill: int = 0) -> None:
        if budget < 0 or spill < 0:
            raise ValueError(f"state cache budgets cannot be negative, got budget={budget}, spill={spill}")
        self.budget = budget
        self.spill = spill if budget else 0
        self._device: OrderedDict[str, CachedState] = OrderedDict()
        self._host: OrderedDict[str, CachedState] = OrderedDict()
        self._device_bytes = 0
        self._host_bytes = 0
        self._lock = threading.RLock()
        self._counts = dict.fromkeys(("hits", "misses", "stores", "evictions", "spills", "rejected",
                                      "memory_clears"), 0)

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._device) + len(self._host)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._device or key in self._host

    def get(self, key: str, uses: int = 1) -> CachedState | None:
        """The entry of ``key`` on the device (moved back from host memory if it was spilled), made most recent,
        or None. Counts ``uses`` hits when found; else one miss (the state pass the caller will run) and
        ``uses - 1`` hits (the batch mates that share that pass)."""
        if uses < 1:
            raise ValueError(f"uses must be ≥ 1, got {uses}")
        with self._lock:
            entry = self._device.get(key)
            if entry is not None:
                self._device.move_to_end(key)
            elif key in self._host:
                spilled = self._host.pop(key)
                self._host_bytes -= spilled.nbytes
                entry = spilled.to_device()
                self._insert(key, entry)
            if entry is None:
                self._counts["misses"] += 1
                self._counts["hits"] += uses - 1
            else:
                self._counts["hits"] += uses
            return entry

    def put(self, key: str, entry: CachedState) -> bool:
        """Store ``entry`` as the most recent; older entries are spilled or evicted to make room. False (and
        nothing stored) when the entry alone exceeds the budget or the cache is off."""
        with self._lock:
            if not self.enabled or entry.nbytes > self.budget:
                self._counts["rejected"] += 1
                return False
            self._discard(key)
            self._insert(key, entry)
            self._counts["stores"] += 1
            return True

    def clear(self, *, out_of_memory: bool = False) -> int:
        """Drop every entry (device and host); returns the bytes released. ``out_of_memory``: counted as a
        memory clear (a pass ran out of memory with the cache in place)."""
        with self._lock:
            freed = self._device_bytes + self._host_bytes
            self._device.clear()
            self._host.clear()
            self._device_bytes = self._host_bytes = 0
            if out_of_memory:
                self._counts["memory_clears"] += 1
            return freed

    def sizes(self, memory: str = "device") -> dict[str, int]:
        """``{key: bytes}`` of the entries on the device (``memory="host"``: spilled), least recent first."""
        if memory not in ("device", "host"):
            raise ValueError(f"memory is 'device' or 'host', got {memory!r}")
        with self._lock:
            tier = self._device if memory == "device" else self._host
            return {key: entry.nbytes for key, entry in tier.items()}

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(**self._counts, entries=len(self._device), bytes=self._device_bytes,
                              budget=self.budget, host_entries=len(self._host), host_bytes=self._host_bytes,
                              host_budget=self.spill)

    def _discard(self, key: str) -> None:
        if key in self._device:
            self._device_bytes -= self._device.pop(key).nbytes
        if key in self._host:
            self._host_bytes -= self._host.pop(key).nbytes

    def _insert(self, key: str, entry: CachedState) -> None:
        """Add to the device tier as most recent, then push the least recent others out until it fits."""
        self._device[key] = entry
        self._device_bytes += entry.nbytes
        while self._device_bytes > self.budget:
            old_key, old = self._device.popitem(last=False)
            self._device_bytes -= old.nbytes
            if 0 < old.nbytes <= self.spill:
                self._spill(old_key, old)
            else:
                self._counts["evictions"] += 1

    def _spill(self, key: str, entry: CachedState) -> None:
        self._host[key] = entry.to_host()
        self._host_bytes += entry.nbytes
        self._counts["spills"] += 1
        while self._host_bytes > self.spill:
            _, old = self._host.popitem(last=False)
            self._host_bytes -= old.nbytes
            self._counts["evictions"] += 1
