"""int4's two stored layouts on the demo model: MLX affine (float biases) vs compressed-tensors' pack-quantized
(integer zero points, ``--int4-layout compressed``), each on both grids (mse, mlx), by drift from the release.

    python benchmarks/int4_layouts.py --out DIR                  # the demo's default group (32, from its source)
    python benchmarks/int4_layouts.py --out DIR --group-size 64

Exports the four variants with ``validate=False`` (kept in DIR, reused when present), prints their sizes as a
Markdown table, then runs ``clef-local drift --reference DEMO --candidate … --limit 64 --dtype float32`` (the
probe set; KL with its interval, flips, and which candidate is closer) and prints its tables.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

LAYOUTS = ("mlx", "compressed")
GRIDS = ("mse", "mlx")


def main() -> None:
    from clef_local.demo.default import default_model_path
    from clef_local.export.quantize import quantize_release
    from clef_local.quality import drift_cli

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the variants are written (default: a temporary directory)")
    parser.add_argument("--group-size", type=int, help="int4 group (default: quantize's, 32 for the demo)")
    parser.add_argument("--limit", type=int, default=64, help="probe requests for drift (default 64)")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="int4-layouts-"))
    root.mkdir(parents=True, exist_ok=True)
    source = default_model_path()
    variants = []
    print("| variant | layout | grid | group | linear bits per weight | directory MB |\n|---|---|---|---|---|---|")
    for layout in LAYOUTS:
        for grid in GRIDS:
            out = root / f"int4{'-g' + str(args.group_size) if args.group_size else ''}-{layout}-{grid}"
            if not out.exists():
                quantize_release(source, out, "int4", args.group_size, validate=False, log_summary=False,
                                 int4_grid=grid, int4_layout=layout)
            manifest = json.loads((out / "clef_local_manifest.json").read_text())
            size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
            print(f"| {out.name} | {layout} | {grid} | {manifest['scheme']['group_size']} | "
                  f"{manifest['scheme']['bits_per_weight']:.3f} | {size / 1e6:.1f} |")
            variants.append(out)
    print()
    argv = ["--reference", str(source), "--limit", str(args.limit), "--dtype", "float32", "--no-progress"]
    for out in variants:
        argv += ["--candidate", str(out)]
    print(f"clef-local drift {' '.join(argv)}\n")
    drift_cli.main(argv)


if __name__ == "__main__":
    main()
