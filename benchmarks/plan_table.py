"""The README's sizing table: Clef-flash (9B) and Clef (27B) on 24/48/80/141 GB cards and 36/64/128 GB Macs.

    python benchmarks/plan_table.py                                  # packaged configs, 16,384 tokens, batch 1
    python benchmarks/plan_table.py --context 4096 --configs DIR

Estimates only (clef_local.planning.planner; no tensor is loaded): the memory each format needs (cards: embed_tokens and
lm_head in host memory, docs/hardware.md; Macs: one pool, MLX dequantizes nf4/fp8 at load so they count as BF16), then
the best-precision format that fits each device. Prints two Markdown tables.
Tables in docs/benchmarks.md#memory-planning.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from clef_local.planning.census import FORMATS
from clef_local.planning.choice import resident_census
from clef_local.planning.estimate import best_fit, plan
from clef_local.planning.hardware import named_device
from clef_local.planning.planner import CONFIGS_DIR, footprint_from_config
from clef_local.units import GiB

DEVICES = ("rtx4090", "l40s", "h100", "h200", "mac-36", "mac-64", "mac-128")
LABELS = {"rtx4090": "24 GB (RTX 4090)", "l40s": "48 GB (L40S)", "h100": "80 GB (H100)", "h200": "141 GB (H200)",
          "mac-36": "Mac 36 GB", "mac-64": "Mac 64 GB", "mac-128": "Mac 128 GB"}
MODELS = (("Clef-flash 9B", "clef-flash"), ("Clef 27B", "clef"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", type=Path, default=CONFIGS_DIR,
                        help="folder holding clef-flash.config.json and clef.config.json (default: the packaged ones)")
    parser.add_argument("--context", type=int, default=16_384)
    args = parser.parse_args(argv)
    card, mac = named_device("rtx4090"), named_device("mac-64")
    footprints = {label: footprint_from_config(args.configs / f"{stem}.config.json") for label, stem in MODELS}
    print(f"Memory needed at {args.context:,} tokens, batch 1, bf16 activations (GiB: weights on the device + "
          "activations + overhead and margin)\n")
    print("| model | where | " + " | ".join(FORMATS) + " |")
    print("|---|---|" + "---:|" * len(FORMATS))
    for label, fp in footprints.items():
        for where, hw in (("CUDA card (embeddings on host)", card), ("Mac (one pool, MLX)", mac)):
            cells = []
            for fmt in FORMATS:
                census = fp.censuses[fmt] if hw.kind == "cuda" else resident_census(fp.censuses[fmt], "mlx")
                p = plan(census, fp.dims, hw, context=args.context, dtype="bfloat16")
                cells.append(f"{p.need / GiB:.1f}")
            print(f"| {label} | {where} | " + " | ".join(cells) + " |")
    print(f"\nBest-precision format that fits at {args.context:,} tokens (need / available GiB)\n")
    print("| model | " + " | ".join(LABELS[d] for d in DEVICES) + " |")
    print("|---|" + "---|" * len(DEVICES))
    for label, fp in footprints.items():
        cells = []
        for name in DEVICES:
            hw = named_device(name)
            plans = {fmt: plan(c if hw.kind == "cuda" else resident_census(c, "mlx"), fp.dims, hw,
                               context=args.context, dtype="bfloat16") for fmt, c in fp.censuses.items()}
            best = best_fit(plans)
            cells.append(f"**{best.fmt}** ({best.need / GiB:.1f} / {best.available / GiB:.0f})" if best
                         else f"none (int4 needs {plans['int4'].need / GiB:.1f})")
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
