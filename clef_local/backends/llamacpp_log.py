"""llama.cpp's log, routed to Python logging: the one place that installs the binding's log callback.

llama.cpp logs through one process-wide callback (``llama_log_set``); without one it writes to stderr. Every user of
the binding in clef-local — the backend's context and export-gguf's quantizer — gets the binding from
:func:`llama_cpp_module`, which installs the routing (and never resets it: a NULL callback would send llama.cpp's
lines back to stderr). Lines arrive in pieces and are logged whole under :data:`LOG_NAME`, at the level of the piece
that began them; the loader's and the quantizer's chatter (INFO) at DEBUG. A caller that needs the lines themselves
(the quantizer's progress and its error line) listens with :func:`listening` while the routing stays in place.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

LOG_NAME = __name__  # llama.cpp's own log lines, under this module's name
LogListener = Callable[[int, str], None]  # (Python logging level, whole line)

_log_lock = threading.Lock()
# the installed callback (kept alive here: C calls it later), the line being assembled and the level it began with
_log_state: dict[str, Any] = {"line": "", "line_level": logging.DEBUG}
_listeners: list[LogListener] = []
_CONT = 5  # GGML_LOG_LEVEL_CONT: continues the line of the piece before, at its level
# enum ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5; INFO is the loader's metadata dump and
# buffer sizes (hundreds of lines per load) and the quantizer's line per tensor: DEBUG here
_GGML_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
# warnings clef-local triggers on purpose: pooling none on a generative model, a context below the trained one, a
# quantizer falling back on a narrow model (the types it really wrote are read back into gguf_config.json), and the
# recurrent state seeing M-RoPE positions jump (an image's rows share one temporal position; the text after it
# starts past its height and width: Qwen's multimodal rope, gguf_vision)
_EXPECTED = ("model default pooling_type", "n_ctx_seq (", "required fallback quantization",
             "non-consecutive token position")


def _forward_log(level: int, text: bytes | None, _user_data: Any) -> None:
    """llama.cpp's log callback: whole lines to :data:`LOG_NAME` and to the listeners."""
    piece = (text or b"").decode("utf-8", "replace")
    pending = _log_state["line"]
    if not pending and level != _CONT:
        _log_state["line_level"] = _GGML_LEVELS.get(level, logging.DEBUG)
    *whole, rest = (pending + piece).split("\n")
    logger = logging.getLogger(LOG_NAME)
    for item in whole:
        line = item.rstrip()
        if line.strip():
            line_level = _log_state["line_level"]
            logger.log(logging.DEBUG if any(e in line for e in _EXPECTED) else line_level, "%s", line)
            for listener in tuple(_listeners):
                listener(line_level, line)
        if level != _CONT:  # the next line begins within this piece: its level
            _log_state["line_level"] = _GGML_LEVELS.get(level, logging.DEBUG)
    _log_state["line"] = rest


def llama_cpp_module() -> Any:
    """The ``llama_cpp`` binding, its log routed to Python logging and its backend initialised (once per process)."""
    import llama_cpp

    with _log_lock:
        if "callback" not in _log_state:
            _log_state["callback"] = llama_cpp.llama_log_callback(_forward_log)  # referenced: C calls it later
            llama_cpp.llama_backend_init()
        # set on every use: importing parts of the binding (its own logger) may have set another callback
        llama_cpp.llama_log_set(_log_state["callback"], ctypes.c_void_p(0))
    return llama_cpp


@contextlib.contextmanager
def listening(listener: LogListener) -> Iterator[Any]:
    """Within the block, also give every whole line of llama.cpp's log to ``listener(level, line)`` (a Python
    logging level); yields the binding (:func:`llama_cpp_module`). The routing to logging stays as it is."""
    lib = llama_cpp_module()
    with _log_lock:
        _listeners.append(listener)
    try:
        yield lib
    finally:
        with _log_lock:
            _listeners.remove(listener)
