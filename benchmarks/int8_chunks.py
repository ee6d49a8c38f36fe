"""int8's blocked dequantize-matmul by block size: one Clef-flash MLP weight (12288 × 4096, bf16 activations), the
dense bf16 matmul of the same shape beside it, in one process.

    python benchmarks/int8_chunks.py                          # rows 615, 2048, 8192; chunks 256, 1024, 4096, 12288
    python benchmarks/int8_chunks.py --rows 615 --chunks 256 4096 --repeats 5

Each cell: the median of ``--repeats`` calls of ``clef_local.quant.int8.blocked_matmul(x, packed, chunk=C)`` (C output
features converted to bf16 per block, one matmul per block) and its GFLOP/s (2 · rows · out · in / time), and the
share of the dense matmul's. Threads: torch's default. Table in docs/benchmarks.md#int4-and-int8-on-a-cpu.
"""

from __future__ import annotations

import argparse
import sys

import torch
from _timing import median_ms

from clef_local.quant import int8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[615, 2048, 8192])
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 1024, 4096, 12288])
    parser.add_argument("--shape", default="12288x4096", help="out x in (default Clef-flash's MLP)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    out_f, in_f = (int(v) for v in args.shape.split("x"))
    torch.manual_seed(0)
    weight = torch.randn(out_f, in_f, dtype=torch.bfloat16) * 0.02
    packed = int8.quantize(weight)
    print(f"int8 blocked_matmul, weight {out_f} x {in_f}, {torch.get_num_threads()} threads\n")
    print("| rows | dense bf16 ms | " + " | ".join(f"chunk {c} ms (share of dense)" for c in args.chunks) + " |")
    print("|---:|---:|" + "---:|" * len(args.chunks))
    for rows in args.rows:
        x = torch.randn(rows, in_f, dtype=torch.bfloat16)
        dense = median_ms(lambda x=x: x @ weight.T, args.repeats)
        cells = []
        for chunk in args.chunks:
            ms = median_ms(lambda x=x, c=chunk: int8.blocked_matmul(x, packed, chunk=c), args.repeats)
            cells.append(f"{ms:.0f} ({dense / ms:.0%})")
        print(f"| {rows} | {dense:.0f} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
