"""``joint_head_config.json`` as a dataclass, free of torch so every backend (torch, MLX, ONNX) can read it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class HeadConfig:
    """``joint_head_config.json``: the only keys a release may carry (DESIGN §2)."""

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
