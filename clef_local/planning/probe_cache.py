"""The cache of what this machine measured once (:mod:`.dtype_probe`'s BF16 speed, :mod:`.read_probe`'s disk rate):
one JSON object per file in the user cache, an entry per key, read forgivingly (an unreadable file is measured
again) and written atomically (a file that cannot be written is logged, not fatal: the measurement still answers
this process).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def probe_file(name: str, cache: Path | None = None) -> Path:
    """``name`` in ``cache`` (None: the user cache, :func:`clef_local.demo.default.cache_dir`)."""
    if cache is None:
        from clef_local.demo.default import cache_dir

        cache = cache_dir()
    return cache / name


def read_entries(path: Path) -> dict[str, Any]:
    """The cached entries by key; none when the file is missing, unreadable (logged) or not a JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("%s is unreadable (%s): measuring again", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def cached_entry(path: Path, key: str) -> Any:
    """The entry cached under ``key`` (None: not measured yet), as stored: the caller checks its shape."""
    return read_entries(path).get(key)


def store_entry(path: Path, key: str, entry: dict[str, Any], what: str) -> None:
    """Add ``entry`` under ``key`` to the cache, atomically; ``what`` names the measurement in the warning when the
    cache cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = read_entries(path) | {key: entry}
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot cache %s in %s (%s); it will be measured again next time", what, path, exc)
