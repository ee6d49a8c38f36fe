"""Which gated-delta-net implementation runs, read from what transformers resolved (logged at load, in inspect)."""

from __future__ import annotations

import importlib.util
import logging
import types
from pathlib import Path

import pytest

import clef_local
from clef_local.backends import linear_attention as la


def _resolved(implementation: object, is_new_implementation: bool) -> types.FunctionType:
    """A function wrapped the way transformers 5 wraps a kernel it resolved (a closure over both names)."""
    def wrapped(*args: object, **kwargs: object) -> object:
        return implementation if is_new_implementation else None
    return wrapped  # type: ignore[return-value]


def test_this_cpu_runs_the_reference_paths(tiny_qwen: Path, tiny_llama: Path) -> None:
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed here")
    paths = la.linear_attention_paths()
    assert paths == {"chunk_gated_delta_rule": la.REFERENCE, "causal_conv1d": la.REFERENCE}
    assert clef_local.load(tiny_qwen, dtype="float32").describe()["linear_attention"] == paths
    assert "linear_attention" not in clef_local.load(tiny_llama, dtype="float32").describe()  # no such layers


def test_a_resolved_kernel_is_named_and_the_reference_on_cuda_warns(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    def chunk_gated_delta_rule() -> None: ...

    chunk_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule.chunk"
    fake = types.SimpleNamespace(torch_chunk_gated_delta_rule=_resolved(chunk_gated_delta_rule, True),
                                 causal_conv1d_fn=_resolved(print, False))
    monkeypatch.setattr(la.importlib, "import_module", lambda name: fake)
    assert la.linear_attention_paths() == {
        "chunk_gated_delta_rule": "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule",
        "causal_conv1d": la.REFERENCE}
    with caplog.at_level(logging.INFO, logger=la.__name__):
        la.log_linear_attention_paths("cuda")
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # the delta rule is fast; conv1d alone is cheap
    fake.torch_chunk_gated_delta_rule = _resolved(print, False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=la.__name__):
        la.log_linear_attention_paths("cuda")
        la.log_linear_attention_paths("cpu")
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]
    assert "pip install 'clef-local[cuda]'" in caplog.records[0].getMessage()
    fake.causal_conv1d_fn = len  # not a closure: a transformers that wraps kernels differently
    assert la.linear_attention_paths()["causal_conv1d"].startswith("unknown (transformers ")
