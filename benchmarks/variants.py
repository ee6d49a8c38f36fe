"""Quantized variants of one release against its BF16 reference: drift, quality, CPU latency and memory.

    python benchmarks/variants.py --model DIR --rows 500               # exports int8, fp8, int4, nf4 beside DIR
    python benchmarks/variants.py --model DIR --variants int4=DIR-int4 # or measure existing variants
    python benchmarks/variants.py --variants int4-g32=DIR --schemes int8 --rows 500 --dtype bfloat16
    python benchmarks/variants.py --calibrate                        # and each scheme's GPTQ variant (--calibrate)

BANKING77 test rows (77-way choice) through the reference and each variant: mean KL(ref‖var), flip rate, accuracy
and ECE (15 bins) of both; the same drift on ``quantize``'s 64 validation probes; then a 3-question request:
median latency (of 10) and the peak RSS of a fresh process that loads the model and answers it. One table.
Targets (the export's validation thresholds): int8/fp8 mean KL ≤ 0.002 and flips ≤ 1%;
int4/nf4 mean KL ≤ 0.03 and flips ≤ 5%.
Tables in docs/benchmarks.md#quantized-variants-of-the-demo-model and docs/benchmarks.md#gptq---calibrate.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from _timing import median_ms

import clef_local
from clef_local.data.datasets import banking77_examples, banking77_intents
from clef_local.data.probes import probe_requests
from clef_local.export.quantize import quantize_release
from clef_local.export.validate import compare
from clef_local.quality.drift import head_difference
from clef_local.quality.metrics import classification_report

SCHEMES = ("int8", "fp8", "int4", "nf4")
THREE = {"model": "clef-local", "state": "My card payment was declined twice at the supermarket today.",
         "questions": {"complaint": {"type": "noul", "instructions": "Is the customer complaining?"},
                       "topic": {"type": "choice", "criteria": {"cards": None, "transfers": None, "account": None}},
                       "urgency": {"type": "score", "criteria": ["low", "medium", "high"]}}}
_RSS = """
import json, sys
import clef_local
model = clef_local.load(sys.argv[1], dtype=sys.argv[2])
model.decide(json.loads(sys.argv[3]))
# VmHWM, not ru_maxrss: Linux carries the parent's maxrss into a forked+exec'd child, so ru_maxrss read the
# benchmark's own (larger) peak for every variant
print(next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def peak_rss_mib(path: Path, dtype: str) -> float:
    """Peak RSS of a fresh process that loads ``path`` and answers the 3-question request."""
    out = subprocess.run([sys.executable, "-c", _RSS, str(path), dtype, json.dumps(THREE)], capture_output=True,
                         text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) / 2**20


def measure(path: Path, rows: int, dtype: str) -> dict:
    examples = banking77_examples("test", limit=rows)
    order = sorted(banking77_intents())
    model = clef_local.load(path, dtype=dtype)
    predictions = model.predict([e.request for e in examples])
    probs = [p.probabilities for p in predictions]
    gold = np.array([order.index(e.labels["intent"]) for e in examples])
    report = classification_report(np.stack([p[0] for p in probs]), gold)
    probes = [p.probabilities for p in model.predict(probe_requests())]
    return {"probabilities": probs, "probes": probes, "accuracy": report["accuracy"], "ece": report["ece"],
            "latency_ms": median_ms(lambda: model.decide(THREE), 10), "peak_rss_mib": peak_rss_mib(path, dtype)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="the BF16 reference release (default: the default model)")
    parser.add_argument("--variants", nargs="*", default=[], metavar="SCHEME=DIR", help="existing variants")
    parser.add_argument("--rows", type=int, default=500, help="BANKING77 test rows (the first N; the tables use 500)")
    parser.add_argument("--dtype", default="auto", help="compute dtype for every model (auto: as stored)")
    parser.add_argument("--schemes", default=",".join(SCHEMES),
                        help="schemes exported beside the release when not given in --variants (default: all four; "
                             "'' for none)")
    parser.add_argument("--calibrate", action="store_true",
                        help="also export and measure each scheme's GPTQ variant (DIR-<scheme>-gptq)")
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args()
    reference_dir = args.model or clef_local.default_model_path()
    variants = dict(v.split("=", 1) for v in args.variants)
    for scheme in filter(None, args.schemes.split(",")):
        if scheme not in SCHEMES:
            raise SystemExit(f"--schemes: unknown scheme {scheme!r}; use {', '.join(SCHEMES)}")
        if scheme not in variants:
            out = reference_dir.with_name(f"{reference_dir.name}-{scheme}")
            if not out.exists():
                quantize_release(reference_dir, out, scheme, validate=False)
            variants[scheme] = str(out)
        if args.calibrate:
            out = reference_dir.with_name(f"{reference_dir.name}-{scheme}-gptq")
            if not out.exists():
                quantize_release(reference_dir, out, scheme, validate=False, calibrate=True)
            variants[f"{scheme} gptq"] = str(out)
    reference = measure(reference_dir, args.rows, args.dtype)
    rows = [{"model": f"reference ({args.dtype})", "mean_kl": 0.0, "flip_rate": 0.0, "probe_kl": 0.0,
             "probe_flips": 0.0, **_public(reference)}]
    for scheme, path in variants.items():
        if (difference := head_difference(reference_dir, path)) is not None:
            print(f"warning: {difference}", file=sys.stderr)  # e.g. a DIR-<scheme> left from an older head
        result = measure(Path(path), args.rows, args.dtype)
        drift = compare(reference["probabilities"], result["probabilities"])
        probe = compare(reference["probes"], result["probes"])
        rows.append({"model": scheme, "mean_kl": drift["mean_kl"], "flip_rate": drift["flip_rate"],
                     "probe_kl": probe["mean_kl"], "probe_flips": probe["flip_rate"], **_public(result)})
    print(f"\n{args.rows} BANKING77 test rows (77-way) + a 3-question request, reference {reference_dir}")
    print(f"{'model':<16}{'mean KL':>10}{'flips':>8}{'accuracy':>10}{'ECE':>8}{'probe KL':>10}{'flips':>8}"
          f"{'ms (3 q)':>10}{'peak MiB':>10}")
    for row in rows:
        print(f"{row['model']:<16}{row['mean_kl']:>10.5f}{row['flip_rate']:>8.3f}{row['accuracy']:>10.3f}"
              f"{row['ece']:>8.3f}{row['probe_kl']:>10.5f}{row['probe_flips']:>8.3f}{row['latency_ms']:>10.1f}"
              f"{row['peak_rss_mib']:>10.0f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def _public(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("probabilities", "probes")}


if __name__ == "__main__":
    main()
