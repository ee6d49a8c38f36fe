"""int4 and int8 linear layers on a CPU, per call: the old dequantize-then-matmul against what the layers run now.

    python benchmarks/quant_cpu_kernels.py                       # Clef-flash's MLP shape, 12288 x 4096, bf16
    python benchmarks/quant_cpu_kernels.py --shape 4096x4096 --rows 64,615 --schemes int4 --repeats 5

One table, one row per (scheme, rows of the call): median ms of ``dequantize (old)`` (``F.linear(x,
dequantize(stored))``: the whole weight rebuilt through float32 on every call, what a CPU ran before), torch's
packed kernel alone (``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm``), the blocked dequantize-matmul alone
(``clef_local.quant.int4_cpu.blocked_matmul`` / ``clef_local.quant.int8.blocked_matmul``), ``new path`` (the
layer's forward as loaded: ``Int4Linear`` / ``Int8Linear`` after ``prepare_quantized``, which picks between the two
by rows) and the BF16 dense matmul of the same shape; then GFLOP/s (2·rows·out·in / time) of the old and new paths
and of the dense matmul, and the new path's share of the CPU's BF16 peak: the best dense GFLOP/s of the table.
Threads: every physical core (the one-shot rule, clef_local.planning.hardware.thread_plan) unless ``--threads``.
Table in docs/benchmarks.md#int4-and-int8-on-a-cpu.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
from _timing import median_ms
from torch import nn
from torch.nn import functional as F

from clef_local.backends.quantized import prepare_quantized, quantized_prefixes, swap_linears
from clef_local.planning.hardware import thread_plan
from clef_local.quant import int4, int4_cpu, int8


def loaded_layer(stored: dict[str, torch.Tensor], scheme: str, out_f: int, in_f: int,
                 dtype: torch.dtype) -> tuple[nn.Module, str]:
    """The scheme's layer as a variant loads it (meta build, stored tensors assigned, kernel prepared)."""
    headers = {f"0.{k}": (tuple(v.shape), v.dtype) for k, v in stored.items()}
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(in_f, out_f, bias=False))
    swap_linears(model, quantized_prefixes(headers, scheme), headers, dtype=dtype)
    model.load_state_dict({f"0.{k}": v.clone() for k, v in stored.items()}, assign=True)
    return model, prepare_quantized(model)["0"]


def paths(scheme: str, weight: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], dict[str, Callable]]:
    """(stored tensors, {path: x -> x @ W.T}) for the old dequantize, torch's kernel and the blocked matmul."""
    dtype = weight.dtype
    if scheme == "int4":
        stored = int4.quantize(weight, group_size)
        repacked = int4_cpu.repack(stored, group_size, dtype, int4_cpu.cpu_layout())
        return stored, {
            "old": lambda x: F.linear(x, int4.dequantize(stored, group_size, x.dtype)),
            "kernel": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, repacked.weight, group_size,
                                                                          repacked.scales_and_zeros),
            "blocked": lambda x: int4_cpu.blocked_matmul(x, repacked, int4_cpu.cpu_layout())}
    stored = int8.quantize(weight)
    scale = stored["weight_scale"].reshape(-1).to(dtype)
    return stored, {"old": lambda x: F.linear(x, int8.dequantize(stored, x.dtype)),
                    "kernel": lambda x: torch.ops.aten._weight_int8pack_mm(x, stored["weight"], scale),
                    "blocked": lambda x: int8.blocked_matmul(x, stored)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="12288x4096", help="OUTxIN of the weight (default: Clef-flash's MLP)")
    parser.add_argument("--rows", default="16,64,128,256,615,1024,2048", help="rows per call, comma-separated")
    parser.add_argument("--schemes", default="int4,int8", help="int4, int8 or both")
    parser.add_argument("--group-size", type=int, default=64, help="int4 group size")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="activations (the dense column is this dtype too)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per cell after one warm-up")
    parser.add_argument("--threads", type=int, help="intra-op threads (default: every physical core)")
    args = parser.parse_args(argv)
    out_f, in_f = (int(v) for v in args.shape.lower().split("x"))
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(thread_plan(threads=args.threads, role="command").intra_op)
    weight = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0)).mul_(0.02).to(dtype)
    print(f"weight {out_f} x {in_f}, {args.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"int4 layout {int4_cpu.cpu_layout()}, median of {args.repeats}")
    table = []
    for scheme in args.schemes.split(","):
        if scheme not in ("int4", "int8"):
            parser.error(f"--schemes: {scheme!r} is not int4 or int8")
        stored, fns = paths(scheme, weight, args.group_size)
        layer, kernel = loaded_layer(stored, scheme, out_f, in_f, dtype)
        fns |= {"new": layer, "dense": lambda x: F.linear(x, weight)}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows)).to(dtype)
            with torch.inference_mode():
                times = {name: median_ms(lambda f=fn, v=x: f(v), args.repeats) for name, fn in fns.items()}
            table.append((f"{scheme} ({kernel.split(':')[1]})", rows, times, 2 * rows * out_f * in_f))
            print(f"  {scheme} rows {rows}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in times.items()),
                  file=sys.stderr, flush=True)
    peak = max(flops / times["dense"] / 1e6 for _, _, times, flops in table)
    print()
    print("| layer (kernel) | rows | dequantize (old) ms | packed kernel ms | blocked ms | **new path** ms | "
          "BF16 dense ms | old GFLOP/s | new GFLOP/s | dense GFLOP/s | old / new | new / BF16 peak |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, rows, t, flops in table:
        rate = {k: flops / v / 1e6 for k, v in t.items()}
        print(f"| {name} | {rows} | {t['old']:.1f} | {t['kernel']:.1f} | {t['blocked']:.1f} | **{t['new']:.1f}** | "
              f"{t['dense']:.1f} | {rate['old']:.0f} | {rate['new']:.0f} | {rate['dense']:.0f} | "
              f"{t['old'] / t['new']:.1f}× | {rate['new'] / peak:.0%} |")
    print(f"\nBF16 peak (the best dense matmul above): {peak:.0f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
