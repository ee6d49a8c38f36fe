"""The model used when none is given, and where clef-local keeps what it builds (the user cache).

The default is the embedded demo model ``clef-demo-135m`` (:mod:`clef_local.demo.build`), built into the cache on first
use. An installation without its trained head (a bare checkout before the head was committed) falls back, loudly,
to a tiny *random* release in the Clef layout: it exercises every code path but its answers mean nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

TINY_DEFAULT = "tiny-random-qwen3_5"


def cache_dir() -> Path:
    """``$CLEF_LOCAL_CACHE``, else ``$XDG_CACHE_HOME/clef-local``, else ``~/.cache/clef-local``."""
    if env := os.environ.get("CLEF_LOCAL_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "clef-local"


def default_model_path() -> Path:
    """The default release, built into the cache the first time (atomically: a temp dir renamed into place)."""
    from clef_local.demo.build import demo_available, demo_path

    if demo_available():
        return demo_path(cache_dir())
    return tiny_default_path()


def tiny_default_path() -> Path:
    """A tiny random release in the cache (for installations without the demo head)."""
    target = cache_dir() / TINY_DEFAULT
    if (target / "joint_head.safetensors").is_file():
        return target
    from clef_local.testing import build_tiny_release

    log.warning("no model given: building a tiny RANDOM release at %s (answers are meaningless; pass --model "
                "for a real Clef release)", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{TINY_DEFAULT}-", dir=target.parent))
    try:
        build_tiny_release(staging / "release", backbone="qwen3_5", seed=0)
        if target.exists():  # another process won the race
            return target
        (staging / "release").rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
