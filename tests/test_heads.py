"""One joint schema head, three engines: torch, MLX and numpy give the same logits on the same hidden states.

The inputs are a real backbone pass (a tiny release, float32) over varied records in one padded batch (nouls,
choices of 2 to 40 options, scores, several questions per record, different lengths) and over a batch of equal
lengths (no padding mask at all). The tiny releases' heads are random with every branch live; the demo head (most
branches zero, the state path) is checked too. A seeded fault shows the check can fail.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import clef_local
from clef_local.backends.torch_pass import collate
from clef_local.runtime.encoding import EncodedRecord
from clef_local.runtime.layout import HeadLayout, build_layout

TOLERANCE = 2e-5  # float32: relative to the largest |logit|

Engine = Callable[[np.ndarray, np.ndarray, np.ndarray, HeadLayout], np.ndarray]


def _records(model: Any) -> list[EncodedRecord]:
    requests = [
        {"model": "m", "state": "I was charged twice for my coffee.",
         "questions": {"refund": {"type": "noul", "instructions": "Does the customer want money back?"},
                       "team": {"type": "choice", "criteria": {"cards": "Card payments", "transfers": None}},
                       "urgency": {"type": "score", "criteria": ["low", "medium", "high"]}}},
        {"model": "m", "state": {"ticket": 7, "text": "the app crashes on login", "tags": ["ios", "v2"]},
         "questions": {"which": {"type": "choice", "criteria": {f"intent_{i}": f"about {i}" for i in range(40)}}}},
        {"model": "m", "state": "short", "questions": {"q": {"type": "noul"}}},
        {"model": "m", "state": "a longer state " * 12,
         "questions": {f"s{i}": {"type": "score", "criteria": [f"level {j}" for j in range(2 + i)]} for i in range(5)}},
    ]
    return [model.encode(r) for r in requests]


def _inputs(model: Any, records: list[EncodedRecord]) -> tuple[np.ndarray, np.ndarray, np.ndarray, HeadLayout]:
    """The backbone's hidden states of ``records`` (one padded batch), the mask, the lexical rows, the layout."""
    layout = build_layout(records, max(len(r.input_ids) for r in records))
    ids, mask = collate(records, model.tokenizer.pad_token_id, torch.device("cpu"))
    hidden = model.backend.backbone.forward(ids, mask).float().numpy()
    lexical = model.backend.backbone.output_embedding.detach().float().numpy()[layout.option_token_ids]
    return hidden, mask.numpy(), lexical, layout


def _engines(release: Any) -> dict[str, Engine]:
    from clef_local.heads import numpy_head, torch_head

    head = torch_head.load_head(release)

    def on_torch(hidden: np.ndarray, mask: np.ndarray, lexical: np.ndarray, layout: HeadLayout) -> np.ndarray:
        with torch.inference_mode():
            return head(torch.from_numpy(hidden), torch.from_numpy(mask), torch.from_numpy(lexical),
                        layout.map(torch.from_numpy)).numpy()

    engines: dict[str, Engine] = {"torch": on_torch, "numpy": numpy_head.load_head(release)}
    try:
        import mlx.core as mx

        from clef_local.heads import mlx_head
    except ImportError:  # MLX is a dev dependency on Linux and macOS; elsewhere two engines are compared
        return engines
    mlx = mlx_head.load_head(release)

    def on_mlx(hidden: np.ndarray, mask: np.ndarray, lexical: np.ndarray, layout: HeadLayout) -> np.ndarray:
        with mx.stream(mx.cpu):
            out = mlx(mx.array(hidden), mask, mx.array(lexical), layout)
            return np.array(out.astype(mx.float32))

    engines["mlx"] = on_mlx
    return engines


def disagreements(engines: dict[str, Engine], hidden: np.ndarray, mask: np.ndarray, lexical: np.ndarray,
                  layout: HeadLayout) -> list[str]:
    """Every engine whose logits differ from torch's beyond :data:`TOLERANCE`, with its max difference (each
    engine's is printed: ``pytest -s``)."""
    reference = engines["torch"](hidden, mask, lexical, layout)
    finite = np.isfinite(reference)
    scale = max(1.0, float(np.abs(reference[finite]).max()))
    problems = []
    for name, engine in engines.items():
        got = engine(hidden, mask, lexical, layout)
        if got.shape != reference.shape or not np.array_equal(np.isfinite(got), finite):
            problems.append(f"{name}: shape {got.shape} or padding differs from torch's {reference.shape}")
            continue
        worst = float(np.abs(got[finite] - reference[finite]).max()) / scale
        print(f"{name}: max |Δlogit| / scale {worst:.1e} over {int(finite.sum())} logits")
        if worst > TOLERANCE:
            problems.append(f"{name}: max |Δlogit| / scale {worst:.2e} > {TOLERANCE:.0e}")
    return problems


@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_llama"])
def test_three_engines_agree(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    model = clef_local.load(path, backend="torch", dtype="float32", state_cache=0)
    engines = _engines(model.release)
    records = _records(model)
    padded = _inputs(model, records)
    assert padded[1].min() == 0  # the batch is padded: the memory mask is exercised
    assert disagreements(engines, *padded) == []
    equal = _inputs(model, [records[0], records[0]])
    assert equal[1].min() == 1  # no padding: the unmasked path
    assert disagreements(engines, *equal) == []
    assert set(engines) == {"torch", "numpy"} | ({"mlx"} if importlib.util.find_spec("mlx") else set())


@pytest.mark.slow
def test_three_engines_agree_on_the_demo_head(demo_release: Path) -> None:
    model = clef_local.load(demo_release, backend="torch", dtype="float32", state_cache=0)
    assert disagreements(_engines(model.release), *_inputs(model, _records(model))) == []


def test_a_seeded_fault_is_caught(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The numpy head's joint score with its gate dropped (a plausible porting slip) is reported."""
    from clef_local.heads import numpy_head

    model = clef_local.load(tiny_llama, backend="torch", dtype="float32", state_cache=0)
    inputs = _inputs(model, _records(model))
    original = numpy_head.score_options

    def ungated(p: dict[str, np.ndarray], fields: np.ndarray, options: np.ndarray) -> np.ndarray:
        gate = 1.0 / (1.0 + np.exp(-float(p["residual_gate"])))
        return original(p, fields, options) / gate

    monkeypatch.setattr(numpy_head, "score_options", ungated)
    problems = disagreements(_engines(model.release), *inputs)
    assert [p.split(":")[0] for p in problems] == ["numpy"], problems
