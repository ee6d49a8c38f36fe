"""Export validation loads its models at the context its longest probe needs, and on a machine where even that does
not fit it validates on the longest prefix of the probe set that does, saying so (clef_local.export.validation_context).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from clef_local.errors import InsufficientMemoryError
from clef_local.export.validate import ValidationRefused, ValidationUnavailable, check_validation, validate_export
from clef_local.export.validation_context import MEDIA_TOKENS, ROUND, request_tokens
from clef_local.formats.release import read_release
from clef_local.planning.load_options import LoadOptions
from clef_local.runtime.encoding import encode_request
from clef_local.runtime.schema import validate_request
from clef_local.runtime.tokenizer import ReleaseTokenizer

N = 32  # the packaged set's first 32: a state of ~2.8K tokens in the first block, ~4.4K in the third (tiny Qwen)


def machine_fitting(monkeypatch: pytest.MonkeyPatch, tokens: int) -> None:
    """The loader's plan as on a machine whose memory holds a pass of at most ``tokens`` tokens (the cap's arithmetic
    itself is the planner's, tested in test_planner / test_streaming)."""
    from clef_local.backends import loader

    real = loader.plan_backend

    def plan(release: Any, options: LoadOptions, **kwargs: Any) -> Any:
        if options.max_length is not None and options.max_length > tokens:
            raise InsufficientMemoryError(f"needs more than this machine at {options.max_length:,} tokens")
        return real(release, options, **kwargs)

    monkeypatch.setattr(loader, "plan_backend", plan)


def rounded(tokens: int) -> int:
    return -(-tokens // ROUND) * ROUND


def test_request_tokens_are_the_encoded_lengths(tiny_qwen: Path) -> None:
    release = read_release(tiny_qwen)
    requests = check_validation(release, N, dtype="float32").requests
    tokenizer = ReleaseTokenizer(tiny_qwen)
    expected = [len(encode_request(tokenizer, validate_request(r), max_length=1 << 30).input_ids)
                + MEDIA_TOKENS * len(validate_request(r).images or ()) for r in requests]
    assert request_tokens(release, requests) == expected
    assert release.has_vision and any(validate_request(r).images for r in requests)  # image probes: the allowance
    assert max(expected) > 4 * 1024  # the set holds a long state: the context below is not a default


def test_the_models_load_at_what_the_longest_probe_needs(tiny_qwen: Path) -> None:
    release = read_release(tiny_qwen)
    inputs = check_validation(release, N, dtype="float32")
    lengths = request_tokens(release, inputs.requests)
    assert len(inputs.requests) == N and inputs.left_out == 0
    assert inputs.load_context == rounded(max(lengths))  # not the model's 262,144 nor the loader's 16,384
    assert inputs.context == 65_536  # what a state would be truncated to: the cache's key, unchanged by the probes


def test_a_machine_that_holds_only_the_short_probes_validates_on_the_prefix_and_says_so(
        tiny_qwen: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    release = read_release(tiny_qwen)
    lengths = request_tokens(release, check_validation(release, N, dtype="float32").requests)
    longest = max(range(N), key=lambda i: lengths[i])
    shorter = rounded(max(n for n in lengths if rounded(n) < rounded(lengths[longest])))
    machine_fitting(monkeypatch, shorter + ROUND // 2)
    with caplog.at_level(logging.WARNING, logger="clef_local.export.validation_context"):
        inputs = check_validation(release, N, dtype="float32")
    cut = next(i for i, n in enumerate(lengths) if rounded(n) > shorter)
    assert cut <= longest and len(inputs.requests) == cut and inputs.left_out == N - cut
    assert inputs.load_context == shorter
    assert f"validation runs on the first {cut} of {N} probes" in caplog.text
    assert "a higher --max-memory runs them all" in caplog.text

    variant = tmp_path / "variant"
    variant.symlink_to(tiny_qwen, target_is_directory=True)
    try:
        record = validate_export(release, variant, "int4", n=N, dtype="float32", checked=inputs, cache=False)
    except ValidationRefused as exc:
        assert exc.result is not None
        record = exc.result
    assert record["probes_left_out"] == N - cut and record["context"] == shorter
    assert record["requests"] <= cut


def test_a_machine_too_small_for_the_first_probe_is_refused_before_anything_runs(
        tiny_qwen: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    machine_fitting(monkeypatch, ROUND // 2)
    with pytest.raises(ValidationUnavailable, match="the reference does not fit here, not even streamed"):
        check_validation(read_release(tiny_qwen), N, dtype="float32")
