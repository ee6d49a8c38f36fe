"""Low-rank adapters (LoRA) on a backbone's attention and MLP projections, for training them with the head.

:func:`add_adapters` wraps the chosen linears of the top decoder layers in :class:`LoraLinear` (the base weight
frozen; ``A`` small random, ``B`` zero, so training starts from the backbone as it was); :func:`adapter_factors`
names the factors by the base weight's path, the layout :mod:`clef_local.demo.adapter` stores and merges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    """Which linears get adapters, and their rank: ``rank`` 16 and ``alpha`` 32 (scale ``alpha / rank``) on every
    attention and MLP projection of the top ``layers`` decoder layers (0: all of them)."""

    rank: int = 16
    alpha: float = 32.0
    layers: int = 10
    targets: tuple[str, ...] = ATTENTION + MLP

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def parse(cls, text: str) -> AdapterSpec:
        """``r=16``, ``r=8,alpha=16,layers=12``: the ``--adapters`` flag (every attention and MLP projection)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = {"r": "rank"}.get(key.strip(), key.strip())
            if not sep or key not in ("rank", "alpha", "layers"):
                raise ValueError(f"--adapters: {part!r} is not one of r=N, alpha=X, layers=N")
            try:
                values[key] = float(value) if key == "alpha" else int(value)
            except ValueError as exc:
                raise ValueError(f"--adapters: {key}={value!r} is not a number") from exc
        spec = cls(**values)  # type: ignore[arg-type]
        if spec.rank < 1 or spec.layers < 0 or spec.alpha <= 0:
            raise ValueError(f"--adapters: rank ≥ 1, layers ≥ 0 and alpha > 0, got {text!r}")
        return spec


class LoraLinear(nn.Module):
    """``base(x) + scale · (x @ Aᵀ) @ Bᵀ``: the adapter runs in float32 whatever the base's dtype."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.scale = scale
        bound = 1 / math.sqrt(base.in_features)  # kaiming-uniform as LoRA initialises A; B = 0 starts at the base
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features).uniform_(-bound, bound, generator=generator))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = (x.float() @ self.lora_A.t()) @ self.lora_B.t()
        return self.base(x) + (self.scale * update).to(x.dtype)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (``model.model.layers``) or of Qwen3.5's text model."""
    base = getattr(model, "model", model)
    base = getattr(base, "language_model", base)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers found at model.layers")
    return layers


def add_adapters(model: nn.Module, spec: AdapterSpec, seed: int = 0) -> dict[str, LoraLinear]:
    """Freeze ``model`` and wrap ``spec``'s linears in :class:`LoraLinear`; ``{weight path without .weight: module}``
    (the names of the base model's state dict, e.g. ``model.layers.29.mlp.down_proj``)."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    layers = decoder_layers(model)
    first = 0 if spec.layers == 0 else max(0, len(layers) - spec.layers)
    names = {id(module): name for name, module in model.named_modules()}
    generator = torch.Generator().manual_seed(seed)
    adapted: dict[str, LoraLinear] = {}
    for layer in list(layers)[first:]:
        for block_name in ("self_attn", "mlp"):
            block = getattr(layer, block_name, None)
            for target in spec.targets:
                linear = getattr(block, target, None) if block is not None else None
                if not isinstance(linear, nn.Linear):
                    continue
                path = names[id(linear)]
                wrapped = LoraLinear(linear, spec.rank, spec.scale, generator).to(linear.weight.device)
                setattr(block, target, wrapped)
                adapted[path] = wrapped
    if not adapted:
        raise ValueError(f"no {', '.join(spec.targets)} linears found in the top {spec.layers} layers")
    return adapted


def adapter_factors(adapted: dict[str, LoraLinear]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{weight path without .weight: (A, B)}`` of the adapted linears (detached)."""
    return {name: (module.lora_A.detach(), module.lora_B.detach()) for name, module in adapted.items()}
