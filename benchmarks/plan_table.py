"""The README's sizing table: Clef-flash (9B) and Clef (27B) on 24/48/80/141 GB cards and 36/64/128 GB Macs.

    python benchmarks/plan_table.py                                  # packaged configs, 16,384 tokens, batch 1
    python benchmarks/plan_table.py --context 4096 --configs DIR
    python benchmarks/plan_table.py --streamed                       # + resident / streamed / does not fit, 16K, 64K

``--streamed`` adds a third table: each format on one 24 GB card, two of them (a pipeline split), an H200 and a
36 GB Mac at 16,384 and 65,536 tokens: resident (R, need in GiB), streamed from disk (S, peak GiB and GB read per
pass; the torch backend, on a Mac on the CPU) or does not fit (—).

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
from clef_local.planning.planner import CONFIGS_DIR, Footprint, chunked_prefill, footprint_from_config
from clef_local.units import GiB

STREAM_DESKS = (("one 24 GB card", ("rtx4090",)), ("two 24 GB cards", ("rtx4090", "rtx4090")),
                ("H200", ("h200",)), ("Mac 36 GB", ("mac-36",)))
STREAM_CONTEXTS = (16_384, 65_536)

DEVICES = ("rtx4090", "l40s", "h100", "h200", "mac-36", "mac-64", "mac-128")
LABELS = {"rtx4090": "24 GB (RTX 4090)", "l40s": "48 GB (L40S)", "h100": "80 GB (H100)", "h200": "141 GB (H200)",
          "mac-36": "Mac 36 GB", "mac-64": "Mac 64 GB", "mac-128": "Mac 128 GB"}
MODELS = (("Clef-flash 9B", "clef-flash"), ("Clef 27B", "clef"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", type=Path, default=CONFIGS_DIR,
                        help="folder holding clef-flash.config.json and clef.config.json (default: the packaged ones)")
    parser.add_argument("--context", type=int, default=16_384)
    parser.add_argument("--streamed", action="store_true", help="add the resident / streamed / does not fit table")
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
                p = plan(census, fp.dims, hw, context=args.context, dtype="bfloat16", chunking=chunked_prefill(hw))
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
                               context=args.context, dtype="bfloat16", chunking=chunked_prefill(hw))
                     for fmt, c in fp.censuses.items()}
            best = best_fit(plans)
            cells.append(f"**{best.fmt}** ({best.need / GiB:.1f} / {best.available / GiB:.0f})" if best
                         else f"none (int4 needs {plans['int4'].need / GiB:.1f})")
        print(f"| {label} | " + " | ".join(cells) + " |")
    if args.streamed:
        streamed_table(footprints)
    return 0


def _cell(fp: Footprint, fmt: str, names: tuple[str, ...], context: int) -> str:
    """"R 17.2" (resident, need), "S 9.1 / 53.8 GB" (streamed: peak GiB, GB read per pass) or "—"."""
    from dataclasses import replace

    devices = [named_device(n) for n in names]
    if len(devices) > 1:
        devices = [replace(h, device=f"cuda:{i}") for i, h in enumerate(devices)]
        split = fp.splits(devices, context=context, dtype="bfloat16")[fmt]
        if split.fits:
            return "R " + " + ".join(f"{s.need / GiB:.1f}" for s in split.stages)
    else:
        hw = devices[0]
        census = fp.censuses[fmt] if hw.kind == "cuda" else resident_census(fp.censuses[fmt], "mlx")
        resident = plan(census, fp.dims, hw, context=context, dtype="bfloat16", chunking=chunked_prefill(hw))
        if resident.fits:  # torch chunks a prefill whose one pass does not fit (docs/hardware.md#chunked-prefill)
            return f"R {resident.need / GiB:.1f}" + (f" ({resident.chunk:,}-token chunks)" if resident.chunk else "")
    streamed = fp.streamed(devices[0], context=context, dtype="bfloat16")[fmt]  # streaming runs on one device
    if streamed.fits:
        return f"S {streamed.peak / GiB:.1f} / {streamed.read_bytes / 1e9:.1f} GB"
    return f"— ({streamed.need / GiB:.1f})"


def streamed_table(footprints: dict[str, Footprint]) -> None:
    print("\nResident (R: need GiB), streamed from disk (S: peak GiB / GB read per pass; one device) or does not fit "
          "(—: the streamed need) — bf16 activations, batch 1\n")
    print("| model | context | desk | " + " | ".join(FORMATS) + " |")
    print("|---|---:|---|" + "---|" * len(FORMATS))
    for label, fp in footprints.items():
        for context in STREAM_CONTEXTS:
            for desk, names in STREAM_DESKS:
                cells = [_cell(fp, fmt, names, context) for fmt in FORMATS]
                print(f"| {label} | {context:,} | {desk} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
