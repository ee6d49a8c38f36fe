"""The quantization predicate on the real clef-flash / clef configs (meta device) and on hand-picked names."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

from clef_local.planning.planner import CONFIGS_DIR
from clef_local.quant import predicate

CONFIGS = CONFIGS_DIR  # the packaged Clef / Clef-flash shapes


def _meta_shapes(config_name: str) -> dict[str, tuple[int, ...]]:
    transformers = pytest.importorskip("transformers")
    path = CONFIGS / config_name
    config = transformers.Qwen3_5Config.from_dict(json.loads(path.read_text()))
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


@pytest.mark.parametrize(
    ("config_name", "n_quantized", "n_kept", "n_layers", "n_linear_attn"),
    [("clef-flash.config.json", 200, 560, 32, 24), ("clef.config.json", 400, 784, 64, 48)],
)
def test_real_configs(config_name: str, n_quantized: int, n_kept: int, n_layers: int, n_linear_attn: int) -> None:
    shapes = _meta_shapes(config_name)
    for group_size in (64, 128, None):
        quantized, kept = predicate.split(shapes, group_size)
        assert (len(quantized), len(kept)) == (n_quantized, n_kept)
    n_full_attn = n_layers - n_linear_attn
    # per layer: mlp gate/up/down; linear-attention in_proj_qkv, in_proj_z, out_proj; full-attention q/k/v/o
    assert n_quantized == 3 * n_layers + 3 * n_linear_attn + 4 * n_full_attn
    for name in quantized:
        assert len(shapes[name]) == 2 and name.startswith("model.language_model.layers.")
        assert not re.search(r"norm|embed|visual|lm_head|joint|in_proj_[ab]\.|conv1d", name), name
    reasons = Counter(kept.values())
    assert reasons["vision tower"] == sum(
        name.startswith("model.visual.") and name.endswith(".weight") for name in shapes
    )
    assert kept["lm_head.weight"].startswith("lm_head")
    assert kept["model.language_model.embed_tokens.weight"] == "embedding"
    assert kept["model.language_model.norm.weight"] == "norm"
    assert kept["model.language_model.layers.0.linear_attn.A_log"] == "not a .weight tensor"
    assert kept["model.language_model.layers.0.linear_attn.conv1d.weight"].startswith("not 2-D")
    assert "in_proj_a" in kept["model.language_model.layers.0.linear_attn.in_proj_a.weight"]
    assert "in_proj_b" in kept["model.language_model.layers.0.linear_attn.in_proj_b.weight"]
    total = sum(torch.Size(s).numel() for s in shapes.values())
    share = sum(torch.Size(shapes[n]).numel() for n in quantized) / total
    assert 0.6 < share < 0.95  # most parameters; embeddings, lm_head and the vision tower are the rest


def test_llama_style_names_and_group_divisibility() -> None:
    assert predicate.should_quantize("model.layers.3.self_attn.q_proj.weight", (576, 576), 64) == (
        True,
        predicate.QUANTIZED,
    )
    assert predicate.should_quantize("model.layers.0.mlp.down_proj.weight", (576, 1536), 64)[0]
    assert predicate.should_quantize("model.layers.0.mlp.down_proj.weight", (576, 1500), 64) == (
        False,
        "in_features % group_size != 0",
    )
    assert predicate.should_quantize("model.layers.0.mlp.down_proj.weight", (576, 1500), None)[0]  # no groups
    assert not predicate.should_quantize("model.layers.0.self_attn.q_proj.bias", (576,), 64)[0]
    assert not predicate.should_quantize("model.embed_tokens.weight", (49152, 576), 64)[0]
    assert not predicate.should_quantize("lm_head.weight", (49152, 576), 64)[0]
    assert not predicate.should_quantize("model.layers.0.input_layernorm.weight", (576,), 64)[0]
    assert not predicate.should_quantize("model.layers.0.mlp.gate.weight", (64, 576), 64)[0]  # MoE router
    assert not predicate.should_quantize("model.mtp.layers.0.mlp.up_proj.weight", (64, 576), 64)[0]


def test_joint_head_names_never_selected() -> None:
    w, h, f = 1024, 4096, 4096
    head = {
        "memory_projection.weight": (w, h),
        "question_projection.weight": (w, h),
        "type_embedding.weight": (3, w),
        "hidden_norm.weight": (h,),
        "evidence_layers.0.attention.in_proj_weight": (3 * w, w),
        "evidence_layers.0.attention.out_proj.weight": (w, w),
        "evidence_layers.0.feedforward.0.weight": (f, w),
        "layers.0.self_attn.out_proj.weight": (w, w),
        "layers.0.multihead_attn.out_proj.weight": (w, w),
        "layers.0.linear1.weight": (f, w),
        "layers.0.linear2.weight": (w, f),
        "residual_scorer.0.weight": (w, 4 * w),
        "joint_head.layers.0.self_attn.out_proj.weight": (w, w),
    }
    quantized, kept = predicate.split(head, 64)
    assert quantized == [] and set(kept) == set(head)
