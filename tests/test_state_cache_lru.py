"""The state cache's bookkeeping without a model: sizes, keys, LRU by exact bytes, spill to host, threads."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import pytest

from clef_local.runtime.state_cache import StateCache, parse_size, state_key
from clef_local.units import format_size

MOVES: list[tuple[str, str]] = []  # (tag, "host" | "device") of every move, in order


@dataclass(frozen=True)
class Entry:
    """A stand-in for a backend's entry: a size and where it lives."""

    nbytes: int
    on_host: bool = False
    tag: str = ""

    def to_host(self) -> Entry:
        MOVES.append((self.tag, "host"))
        return Entry(self.nbytes, True, self.tag)

    def to_device(self) -> Entry:
        MOVES.append((self.tag, "device"))
        return Entry(self.nbytes, False, self.tag)


@pytest.mark.parametrize(("text", "size"), [
    ("0", 0), ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1.5GB", 1_500_000_000), ("64 kib", 65536),
    ("100", 100), (".5MiB", 1 << 19), (4096, 4096), ("auto", None), (None, None), (" AUTO ", None)])
def test_sizes_parse(text: str | int | None, size: int | None) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["-1", "12 parsecs", "MiB", "1e9", "", -5, True])
def test_bad_sizes_name_the_value_and_the_forms(text: str | int) -> None:
    with pytest.raises(ValueError, match=r"512MiB|negative|not True") as info:
        parse_size(text)
    assert repr(text) in str(info.value) or str(text) in str(info.value)


def test_format_size() -> None:
    assert [format_size(n) for n in (12, 2048, 512 << 20, 3 << 30)] == ["12 B", "2.0 KiB", "512.0 MiB", "3.0 GiB"]


def test_keys_are_token_ids_identity_and_media() -> None:
    base = state_key("model-a", [1, 2, 3])
    assert base == state_key("model-a", (1, 2, 3))  # any sequence of ids
    assert len({base, state_key("model-b", [1, 2, 3]), state_key("model-a", [1, 2, 4]),
                state_key("model-a", [1, 2]), state_key("model-a", [1, 2, 3], media=b"pixels")}) == 5
    # ids are length-prefixed int64: [1, 2] + [3] never collides with a different split
    assert state_key("m", [258]) != state_key("m", [2, 1])


def test_lru_by_bytes_never_exceeds_the_budget() -> None:
    cache = StateCache(100)
    assert cache.put("a", Entry(40)) and cache.put("b", Entry(40))
    assert cache.get("a") is not None  # a is now the most recent
    assert cache.put("c", Entry(40))  # 120 > 100: b (least recent) goes
    assert "b" not in cache and "a" in cache and "c" in cache
    stats = cache.stats()
    assert (stats.bytes, stats.entries, stats.evictions, stats.stores) == (80, 2, 1, 3)
    assert not cache.put("huge", Entry(101)) and cache.stats().rejected == 1 and "huge" not in cache
    assert cache.put("a", Entry(60))  # replacing a key counts its new size only
    assert cache.stats().bytes == 100 and len(cache) == 2
    assert cache.clear() == 100 and cache.stats().bytes == 0 and len(cache) == 0


def test_random_traffic_keeps_exact_bytes_within_budget() -> None:
    rng = random.Random(0)
    cache = StateCache(1000, spill=500)
    for step in range(2000):
        key = f"k{rng.randrange(40)}"
        if rng.random() < 0.5:
            size = rng.randint(1, 600)
            cache.put(key, Entry(size))
        else:
            cache.get(key)
        stats = cache.stats()
        assert stats.bytes <= 1000 and stats.host_bytes <= 500, step
        assert sum(cache.sizes().values()) == stats.bytes and sum(cache.sizes("host").values()) == stats.host_bytes


def test_hits_and_misses_count_records() -> None:
    cache = StateCache(100)
    assert cache.get("s", uses=3) is None  # one state pass for three records: 1 miss, 2 hits
    cache.put("s", Entry(10))
    assert cache.get("s", uses=2) is not None
    stats = cache.stats()
    assert (stats.misses, stats.hits) == (1, 4)
    with pytest.raises(ValueError, match="uses"):
        cache.get("s", uses=0)


def test_off_stores_nothing() -> None:
    cache = StateCache(0, spill=100)
    assert not cache.enabled and cache.spill == 0
    assert not cache.put("a", Entry(1)) and cache.get("a") is None
    with pytest.raises(ValueError, match="negative"):
        StateCache(-1)


def test_spill_moves_entries_to_host_and_back() -> None:
    MOVES.clear()
    cache = StateCache(100, spill=100)
    cache.put("a", Entry(60, tag="a"))
    cache.put("b", Entry(60, tag="b"))  # a is pushed out of the device: spilled, not dropped
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.host_entries, stats.host_bytes, stats.spills) == (1, 60, 1, 60, 1)
    assert MOVES == [("a", "host")] and list(cache.sizes("host")) == ["a"]
    back = cache.get("a")  # a hit from the host: moved back to the device, b spilled in turn
    assert isinstance(back, Entry) and not back.on_host and back.tag == "a"
    assert MOVES == [("a", "host"), ("a", "device"), ("b", "host")]
    stats = cache.stats()
    assert (stats.hits, stats.entries, stats.host_entries, stats.spills, stats.evictions) == (1, 1, 1, 2, 0)
    cache.put("c", Entry(60))
    cache.put("d", Entry(60))  # the host holds one 60-byte entry: the oldest spilled one is evicted
    stats = cache.stats()
    assert stats.bytes <= 100 and stats.host_bytes <= 100 and stats.evictions >= 1


def test_threads_share_one_cache() -> None:
    cache = StateCache(5000)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(3000):
                key = f"k{rng.randrange(30)}"
                if cache.get(key) is None:
                    cache.put(key, Entry(rng.randint(100, 900)))
                assert cache.stats().bytes <= 5000
        except BaseException as exc:  # reported below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = cache.stats()
    assert stats.hits + stats.misses == 8 * 3000 and stats.hits > 0 and stats.evictions > 0
    assert stats.bytes == sum(cache.sizes().values()) <= 5000
