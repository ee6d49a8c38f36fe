"""torch's int8 / int4 CPU kernels against dequantize-then-matmul, by rows per call (bf16 activations).

    python benchmarks/cpu_kernels.py                       # the demo backbone's two MLP shapes
    python benchmarks/cpu_kernels.py --shapes 4096x4096 --rows 1 64 512

A Clef call is a prefill: every matmul sees a record's whole token count as rows. torch's weight-only CPU kernels
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) cost time per row; dequantize-then-matmul pays a fixed
cost (rebuild W in bf16) and then runs the BF16 GEMM. The table says where each wins; clef_local.backends.quantized
takes its thresholds from it. Milliseconds per call, median of 15 after a warm-up.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from _timing import median_ms

from clef_local.quant import int4, int8


def shape_rows(out_f: int, in_f: int, rows: list[int], group_size: int) -> list[list[float]]:
    """ms per call of [int8 kernel, int8 dequantize+mm, int4 kernel, int4 dequantize+mm, bf16 mm] for each row count."""
    weight = torch.randn(out_f, in_f)
    p8 = int8.quantize(weight)
    p8["weight"] = int8.aligned(p8["weight"])
    p4 = int4.quantize(weight, group_size)
    repacked = int4.to_torch_int4pack(p4, group_size, torch.bfloat16)
    dense = weight.bfloat16()
    calls = (
        lambda x: int8.int8_matmul(x, p8),
        lambda x: F.linear(x, int8.dequantize(p8, torch.bfloat16)),
        lambda x: int4.int4_matmul(x, repacked),
        lambda x: F.linear(x, int4.dequantize(p4, group_size, torch.bfloat16)),
        lambda x: F.linear(x, dense),
    )
    table = []
    for count in rows:
        x = torch.randn(count, in_f, dtype=torch.bfloat16)
        table.append([median_ms(functools.partial(call, x), 15) for call in calls])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1536x576", "576x1536"], help="OUTxIN weight shapes")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 128, 256, 1024])
    parser.add_argument("--group-size", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{'shape':>10} {'rows':>5} {'int8 kernel':>12} {'int8 deq+mm':>12} {'int4 kernel':>12} "
          f"{'int4 deq+mm':>12} {'bf16 mm':>9}")
    for shape in args.shapes:
        out_f, in_f = map(int, shape.split("x"))
        for count, times in zip(args.rows, shape_rows(out_f, in_f, args.rows, args.group_size), strict=True):
            print(f"{shape:>10} {count:>5} " + " ".join(f"{t:>12.3f}" for t in times[:4]) + f" {times[4]:>9.3f}")


if __name__ == "__main__":
    main()
