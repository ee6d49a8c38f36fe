"""transformers' own progress bars ("Loading weights", "Writing model shards"), switched off where they are noise."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def hf_progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' progress bars on or off inside the block, as they were after it. A quick command (``decide``,
    ``inspect``) prints its result and warnings only; its logger is then above INFO and a caller passes
    ``enabled=log.isEnabledFor(logging.INFO)``."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if before:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()
