"""``joint_head_config.json`` as a dataclass, free of torch so every backend (torch, MLX, ONNX) can read it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class HeadConfig:
    """``joint_head_config.json``: the only keys a release may carry (docs/format.md)."""

    hidden_size: int
    width: int
    routing_layers: int
    layers: int
    heads: int
    feedforward: int
    dropout: float = 0.0

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def to_json_dict(self) -> dict[str, int | float]:
        return asdict(self)


_PROJECTIONS = ("memory", "question", "option_question", "global", "option_context", "option_lexical")


def head_tensor_shapes(config: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of ``joint_head.safetensors`` and its shape (docs/format.md §4's state dict)."""
    h, w, f = config.hidden_size, config.width, config.feedforward
    shapes: dict[str, tuple[int, ...]] = {"prior_logit_scale": (), "joint_logit_scale": (), "residual_gate": (),
                                          "type_embedding.weight": (3, w)}

    def norm(name: str, size: int) -> None:
        shapes[f"{name}.weight"] = shapes[f"{name}.bias"] = (size,)

    def attention(name: str) -> None:
        shapes.update({f"{name}.in_proj_weight": (3 * w, w), f"{name}.in_proj_bias": (3 * w,),
                       f"{name}.out_proj.weight": (w, w), f"{name}.out_proj.bias": (w,)})

    def linear(name: str, out_f: int, in_f: int) -> None:
        shapes.update({f"{name}.weight": (out_f, in_f), f"{name}.bias": (out_f,)})

    norm("hidden_norm", h)
    for name in _PROJECTIONS:
        shapes[f"{name}_projection.weight"] = (w, h)
    for i in range(config.routing_layers):
        prefix = f"evidence_layers.{i}"
        for name in ("query_norm", "memory_norm", "feedforward_norm"):
            norm(f"{prefix}.{name}", w)
        attention(f"{prefix}.attention")
        linear(f"{prefix}.feedforward.0", f, w)
        linear(f"{prefix}.feedforward.3", w, f)
    for i in range(config.layers):
        attention(f"layers.{i}.self_attn")
        attention(f"layers.{i}.multihead_attn")
        linear(f"layers.{i}.linear1", f, w)
        linear(f"layers.{i}.linear2", w, f)
        for n in (1, 2, 3):
            norm(f"layers.{i}.norm{n}", w)
    for name in ("option_summary_norm", "field_norm", "option_norm"):
        norm(name, w)
    linear("residual_scorer.0", w, 4 * w)
    linear("residual_scorer.3", 1, w)
    return shapes
