"""How far int4's two grid rules put the weights from the source: relative error per group size.

    python benchmarks/int4_grids.py                      # the demo backbone's linear weights + Gaussian ones
    python benchmarks/int4_grids.py --model DIR --layers 4

For every weight ``clef-local quantize`` would quantize (the predicate at each group size), the round trip
``dequantize(quantize(w))`` with ``grid="mse"`` (the default) and ``grid="mlx"`` (``mx.quantize``'s), and the
relative Frobenius error ``||w' - w|| / ||w||`` over all of them; a Gaussian matrix of the same shape as the first
weight beside. The demo backbone was dequantized from GGUF Q4_1 (16 levels per 32 input columns), which is why g32
with the mse grid gives it back up to bf16 rounding.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from safetensors import safe_open

from clef_local.demo.default import default_model_path
from clef_local.formats.release import read_release
from clef_local.quant import int4
from clef_local.quant.predicate import should_quantize


def weights(model: Path, layers: int | None) -> dict[str, torch.Tensor]:
    """The source's 2-D text linear weights (of the first ``layers`` decoder layers when given)."""
    out = {}
    for file in read_release(model).weight_files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                if not should_quantize(name, tuple(f.get_slice(name).get_shape()), None)[0]:
                    continue
                if layers is not None and not any(f".layers.{i}." in name for i in range(layers)):
                    continue
                out[name] = f.get_tensor(name)
    return out


def relative_error(tensors: dict[str, torch.Tensor], group: int, grid: str) -> tuple[float, int, float]:
    """(relative error over the tensors whose input width the group divides, their count, seconds)."""
    err = norm = 0.0
    count = 0
    started = time.perf_counter()
    for w in tensors.values():
        if w.shape[1] % group:
            continue
        back = int4.dequantize(int4.quantize(w, group, grid), group, torch.float32)
        err += float((back - w.float()).square().sum())
        norm += float(w.float().square().sum())
        count += 1
    return (err / norm) ** 0.5 if norm else float("nan"), count, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="release directory (default: the demo model)")
    parser.add_argument("--layers", type=int, help="only the first N decoder layers (default: all)")
    args = parser.parse_args()
    model = args.model or default_model_path()
    source = weights(model, args.layers)
    first = next(iter(source.values()))
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(first.shape, generator=generator) * float(first.float().std())
    gaussian = {"gaussian": noise.to(first.dtype)}
    print(f"{model}: {len(source)} linear weights, {sum(w.numel() for w in source.values()) / 1e6:.1f} M values\n")
    print("| weights | group | matrices | mse grid | mlx grid | mse / mlx | mse seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, tensors in (("source", source), (f"Gaussian {tuple(first.shape)}", gaussian)):
        for group in int4.GROUP_SIZES:
            mse, count, seconds = relative_error(tensors, group, "mse")
            mlx, _, _ = relative_error(tensors, group, "mlx")
            if count:
                print(f"| {label} | {group} | {count} | {mse:.4f} | {mlx:.4f} | {mse / mlx:.2f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
