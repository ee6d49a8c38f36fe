"""clef_local.backends.llamacpp_log: llama.cpp's log pieces become whole lines under one logger, each at the level of
the piece that began it (the quantizer's per-tensor line with a fallback warning inside stays DEBUG, an error line is
ERROR), listeners get the same lines, and the warnings clef-local causes on purpose are DEBUG. No llama.cpp needed:
the callback is fed the pieces llama.cpp sends (src/llama-quant.cpp's order)."""

from __future__ import annotations

import logging

import pytest

from clef_local.backends import llamacpp_log
from clef_local.backends.llamacpp_log import LOG_NAME

INFO, WARN, ERROR, CONT = 2, 3, 4, 5
PIECES = [
    (INFO, b"[   1/  10] blk.0.attn_q.weight                - [   64,    64,     1,     1], type =   bf16, "),
    (WARN, b"warning: blk.0.attn_q.weight - ncols     64 not divisible by 256 (required for type    q4_K) "),
    (WARN, b"-> falling back to    q5_0\n"),
    (INFO, b"converting to q5_0 .. "),
    (INFO, b"size =     0.01 MiB ->     0.00 MiB\n"),
    (WARN, b"llama_model_quantize_impl: WARNING: 7 of 10 tensor(s) required fallback quantization\n"),
    (WARN, b"llama_model_load: vocab only"),
    (CONT, b" - skipping tensors\n"),
    (ERROR, b"llama_model_quantize: failed to quantize: boom\nsecond"),
    (INFO, b" line\n"),
]


def test_pieces_become_whole_lines_at_the_level_they_began_with(caplog: pytest.LogCaptureFixture) -> None:
    heard: list[tuple[int, str]] = []
    with caplog.at_level(logging.DEBUG, logger=LOG_NAME):
        llamacpp_log._listeners.append(lambda level, line: heard.append((level, line)))
        try:
            for level, text in PIECES:
                llamacpp_log._forward_log(level, text, None)
        finally:
            llamacpp_log._listeners.clear()
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOG_NAME]
    assert [line for _, line in logged] == [line for _, line in heard] == [
        "[   1/  10] blk.0.attn_q.weight                - [   64,    64,     1,     1], type =   bf16, "
        "warning: blk.0.attn_q.weight - ncols     64 not divisible by 256 (required for type    q4_K) "
        "-> falling back to    q5_0",
        "converting to q5_0 .. size =     0.01 MiB ->     0.00 MiB",
        "llama_model_quantize_impl: WARNING: 7 of 10 tensor(s) required fallback quantization",
        "llama_model_load: vocab only - skipping tensors",
        "llama_model_quantize: failed to quantize: boom",
        "second line",
    ]
    assert [level for level, _ in logged] == [logging.DEBUG, logging.DEBUG, logging.DEBUG, logging.WARNING,
                                              logging.ERROR, logging.ERROR]
    # listeners get llama.cpp's own level, the expected fallback warning included
    assert [level for level, _ in heard] == [logging.DEBUG, logging.DEBUG, logging.WARNING, logging.WARNING,
                                             logging.ERROR, logging.ERROR]
