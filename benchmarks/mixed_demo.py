"""Mixed precision on the demo model: size against mean KL for int4, int8 and ``quantize --format mixed`` at two
budgets, each measured on held-out requests the plan was not chosen on.

    python benchmarks/mixed_demo.py --out /tmp/mixed-demo
    python benchmarks/mixed_demo.py --out /tmp/mixed-demo --selection-requests 16 --heldout 48   # shorter

The mixed variants are chosen on probe requests from the training splits (``--selection-requests``) and validated
by the export on the test-split probe set (seed 0); the table then measures every variant against the BF16
reference on another draw of test-split probes (``--heldout`` requests, seed 1), in float32, with 95% intervals
(bootstrap over requests for the KL, exact binomial for the flip rate). Variants are written under ``--out`` (reused
when present). Table in docs/benchmarks.md#mixed-precision.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from clef_local.data.probes import probe_requests
from clef_local.demo.default import default_model_path
from clef_local.quality.drift import drift_from_predictions
from clef_local.quality.intervals import IntervalSettings
from clef_local.quality.tables import cell


def _weights_mb(path: Path) -> float:
    from clef_local.formats.release import read_release

    return read_release(path).weight_bytes / 1e6


def _plan(path: Path) -> str:
    from clef_local.formats.quant_plan import layer_groups, mixed_plan, span
    from clef_local.formats.release import read_release

    plan = mixed_plan(read_release(path).config)
    return "; ".join(f"{span(layers)}: {fmt.label}" for layers, fmt in layer_groups(plan)) if plan else "uniform"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, help="BF16 reference (default: the demo model)")
    parser.add_argument("--out", type=Path, required=True, help="where the variants are written")
    # under uniform int8's drift on the demo (~0.002), so the plan has to choose; the export's validation refused 0.001
    parser.add_argument("--budgets", default="0.00025,0.0005", help="two (or more) --max-kl budgets, nats")
    # plain int4 is group 32 on the demo, which its backbone's grid makes near-lossless (docs/benchmarks.md); int4 g64
    # is the 4-bit format that drifts enough for a per-group choice to matter
    parser.add_argument("--formats", default="int4-g64,int8", help="--mixed-formats")
    parser.add_argument("--uniform", default="int4,int4-g64,int8",
                        help='uniform variants in the table (int4-g64: group 64; "" for none)')
    parser.add_argument("--group-layers", type=int, default=5, help="decoder layers per group (demo: 30)")
    parser.add_argument("--selection-requests", type=int, default=32)
    parser.add_argument("--heldout", type=int, default=96, help="held-out test-split probe requests (seed 1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the export's per-group KL lines
    import clef_local
    from clef_local.export.mixed import mixed_release
    from clef_local.export.quantize import quantize_release
    from clef_local.export.validate import ValidationFailed

    reference = args.reference or default_model_path()
    args.out.mkdir(parents=True, exist_ok=True)
    variants: list[tuple[str, Path, float | None]] = []
    for spec in (s for s in args.uniform.split(",") if s):  # --uniform "": the mixed variants only
        scheme, _, group = spec.partition("-g")
        path = args.out / f"demo-{spec}"
        if not path.is_dir():
            quantize_release(reference, path, scheme, int(group) if group else None, log_summary=False)
        variants.append((spec, path, None))
    refused: list[str] = []
    for budget in (float(b) for b in args.budgets.split(",")):
        path = args.out / f"demo-mixed-{budget:g}"
        if not path.is_dir():
            started = time.perf_counter()
            try:
                summary = mixed_release(reference, path, budget, formats=args.formats,
                                        group_layers=args.group_layers, selection_requests=args.selection_requests)
            except ValidationFailed as exc:  # nothing was written: a row says so, the other budgets still run
                print(f"mixed ≤ {budget:g}: {time.perf_counter() - started:.0f} s, refused: {exc}", flush=True)
                refused.append(f"| mixed ≤ {budget:g} | refused by the export's validation: {exc} | | | | |")
                continue
            validation = summary["validation"]["metrics"]
            print(f"mixed ≤ {budget:g}: {time.perf_counter() - started:.0f} s, export validation mean KL "
                  f"{validation['mean_kl']:.3g} on the test-split probes", flush=True)
        variants.append((f"mixed ≤ {budget:g}", path, budget))
    requests = probe_requests(args.heldout, seed=1)
    settings = IntervalSettings()
    ref = clef_local.load(reference, dtype="float32").predict(requests, truncate_state=True)
    print(f"\nheld out: {len(requests)} test-split probe requests (seed 1), float32; reference "
          f"{_weights_mb(reference):.1f} MB of weights\n")
    print("| variant | formats by layer | weights MB | mean KL [95%] | flip rate [95%] | within its budget |")
    print("|---|---|---|---|---|---|")
    for name, path, budget in variants:
        cand = clef_local.load(path, dtype="float32").predict(requests, truncate_state=True)
        result = drift_from_predictions(ref, cand, requests, intervals=settings)
        iv = result.intervals["all"]
        within = "—" if budget is None else ("yes" if result.summary["kl_mean"] <= budget else "no") + \
            (" (upper bound too)" if budget is not None and iv["kl_mean"][1] <= budget else "")
        print(f"| {name} | {_plan(path)} | {_weights_mb(path):.1f} | {cell(result.summary['kl_mean'], iv['kl_mean'])}"
              f" | {cell(result.summary['flip_rate'], iv['flip_rate'], '.2%')} | {within} |", flush=True)
    print("\n".join(refused))
    return 0


if __name__ == "__main__":
    sys.exit(main())
