"""The demo backbone's LoRA adapter file (``backbone_adapter.safetensors``), merged into the converted weights at build.

:func:`merge_adapter` adds ``scale · B @ A`` as a fixed-order sum of rank-1 products in float32 (elementwise IEEE
operations, no BLAS reduction whose order could differ between machines), rounded once to BF16, so the built release
is the same bytes everywhere and stays a plain Clef release. docs/demo-model.md ("Adapters on the backbone").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from clef_local.errors import ReleaseError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ADAPTER_FILE = "backbone_adapter.safetensors"
FORMAT = "clef-local-lora-1"


@dataclass(frozen=True)
class Adapter:
    """LoRA factors per adapted linear (``{weight path without .weight: (A, B)}``) and the scale of ``B @ A``."""

    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int
    scale: float


def save_adapter(path: Path, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]], *, rank: int,
                 scale: float) -> None:
    """Write ``factors`` (float32) to ``path`` atomically."""
    from safetensors.torch import save_file

    tensors = {}
    for name, (a, b) in sorted(factors.items()):
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{name}: factors {tuple(a.shape)} / {tuple(b.shape)} are not of rank {rank}")
        tensors[f"{name}.lora_A"] = a.detach().float().cpu().contiguous()
        tensors[f"{name}.lora_B"] = b.detach().float().cpu().contiguous()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "rank": str(rank), "scale": repr(float(scale))})
    os.replace(tmp, path)


def read_adapter(path: Path) -> Adapter:
    """The factors of an adapter file; a file of another format, or with an unpaired factor, is a ReleaseError."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ReleaseError(f"{path}: not a clef-local adapter (format {meta.get('format')!r}, expected {FORMAT})")
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    rank, scale = int(meta["rank"]), float(meta["scale"])
    names = {name.rsplit(".", 1)[0] for name in tensors}
    factors = {}
    for name in sorted(names):
        a, b = tensors.get(f"{name}.lora_A"), tensors.get(f"{name}.lora_B")
        if a is None or b is None or a.shape[0] != rank or b.shape[1] != rank:
            raise ReleaseError(f"{path}: {name} lacks a factor or is not of rank {rank}")
        factors[name] = (a, b)
    return Adapter(factors, rank, scale)


def lora_delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale · B @ A`` in float32, as a fixed-order sum of rank-1 outer products (the same bits on any machine)."""
    import torch

    a, b = a.float(), b.float()
    delta = torch.zeros(b.shape[0], a.shape[1], dtype=torch.float32)
    for r in range(a.shape[0]):
        delta.add_(b[:, r : r + 1] * a[r : r + 1, :])
    return delta * torch.tensor(scale, dtype=torch.float32)


def merged_weights(weights: Mapping[str, torch.Tensor], adapter: Adapter) -> dict[str, torch.Tensor]:
    """``weights`` with every adapted linear's delta added (float32 sum, rounded back to the weight's dtype)."""
    out = dict(weights)
    for name, (a, b) in adapter.factors.items():
        key = f"{name}.weight"
        if key not in out:
            raise ReleaseError(f"the adapter adapts {key}, which the backbone does not have")
        weight = out[key]
        if tuple(weight.shape) != (b.shape[0], a.shape[1]):
            raise ReleaseError(f"the adapter's {name} is {b.shape[0]}x{a.shape[1]}, the backbone's weight "
                               f"{tuple(weight.shape)}")
        out[key] = (weight.float() + lora_delta(a, b, adapter.scale)).to(weight.dtype)
    return out


def merge_adapter(model_file: Path, adapter_file: Path) -> int:
    """Add the adapter in ``adapter_file`` to the backbone weights in ``model_file`` (a single safetensors file,
    rewritten atomically with its metadata); returns how many linears were changed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    adapter = read_adapter(adapter_file)
    with safe_open(str(model_file), framework="pt") as f:
        meta = f.metadata()
        weights = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    merged = merged_weights(weights, adapter)
    tmp = model_file.with_name(f".{model_file.name}.tmp-{os.getpid()}")
    save_file(merged, str(tmp), metadata=meta)
    os.replace(tmp, model_file)
    log.info("merged %d adapted linears (rank %d) into %s", len(adapter.factors), adapter.rank, model_file)
    return len(adapter.factors)
