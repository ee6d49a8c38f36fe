"""The sequential verdict of ``quantize`` on the demo model, per scheme, and on a seeded broken variant.

    python benchmarks/verdict_demo.py                 # int8, fp8, int4 g32, int4 g64, nf4, broken int8
    python benchmarks/verdict_demo.py --schemes int4:32 broken
    python benchmarks/verdict_demo.py --validation-requests 256        # int8 / fp8 capped as int4's

Each row is ``clef_local.export.quantize.quantize_release`` with validation as the CLI runs it (default probe set and
its scheme's most requests), into a temporary directory, with a private reference cache (``$CLEF_LOCAL_REFERENCES``,
emptied first): the first row runs the reference live and keeps its answers, the later ones reuse them (the
``reference`` column says which). The table: verdict, probes used of the most allowed, looks, questions, flips,
the flip rate and mean KL with the bounds of the last look against the limits, and wall time. ``broken`` is int8
with its codes replaced by seeded random ones (the test suite's broken variant): it must be refused at the first
look. Table in docs/benchmarks.md#the-verdict-on-the-demo-model.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROWS = ("int8", "fp8", "int4:32", "int4:64", "nf4", "broken")


def broken_int8() -> Any:
    """The int8 row with its codes replaced by seeded random ones."""
    import torch

    from clef_local.quant import registry

    row = registry.SCHEMES["int8"]
    generator = torch.Generator().manual_seed(0)

    def quantize(weight: torch.Tensor, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        out = row.quantize(weight, *args, **kwargs)
        codes = torch.randint(-127, 128, out["weight"].shape, generator=generator, dtype=torch.int8)
        return {**out, "weight": codes}

    return dataclasses.replace(row, quantize=quantize)


def run(model: Path, work: Path, label: str, most: int | None) -> dict[str, Any]:
    from clef_local.export.quantize import quantize_release
    from clef_local.export.validate import ValidationRefused
    from clef_local.quant import registry

    scheme, _, group = label.partition(":")
    saved = registry.SCHEMES["int8"]
    if scheme == "broken":
        registry.SCHEMES["int8"] = broken_int8()
        scheme = "int8"
    started = time.perf_counter()
    try:
        result = quantize_release(model, work / label.replace(":", "-g"), scheme, int(group) if group else None,
                                  validation_requests=most)["validation"]
    except ValidationRefused as exc:
        result = exc.result or {}
    finally:
        registry.SCHEMES["int8"] = saved
    return {"label": label, "seconds": time.perf_counter() - started, **result}


def cell(check: dict[str, Any], digits: int = 4) -> str:
    if "upper" not in check:
        return f"{check['value']:.{digits}g}"
    return (f"{check['value']:.{digits}g} [{check['lower']:.{digits}g}, {check['upper']:.{digits}g}] "
            f"≤ {check['threshold']:g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="the source release (default: the demo model)")
    parser.add_argument("--schemes", nargs="+", default=list(ROWS), help=f"rows among {', '.join(ROWS)}")
    parser.add_argument("--validation-requests", type=int, metavar="N",
                        help="cap every row's probes at N (default: each scheme's most, int8/fp8 1024)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("clef_local.quality.sequential").setLevel(logging.INFO)  # one line per look
    from clef_local.demo.default import default_model_path

    model = args.model or default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CLEF_LOCAL_REFERENCES"] = str(Path(tmp) / "references")
        rows = []
        for label in args.schemes:
            rows.append(run(model, Path(tmp), label, args.validation_requests))
            print(f"{label}: {rows[-1].get('verdict')} after {rows[-1].get('requests')} requests, "
                  f"{rows[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
    print("| variant | verdict | probes used | looks | questions | flips | flip rate [bounds] ≤ limit | "
          "mean KL [bounds] ≤ limit | reference | s |")
    print("|---|---|---:|---:|---:|---:|---|---|---|---:|")
    for r in rows:
        looks = r.get("sequential", {}).get("looks", [])
        answers = r.get("reference_answers", {})
        print(f"| {r['label']} | {r.get('verdict', '—')} | {r.get('requests', '—')} / {r.get('probe_set', '—')} | "
              f"{len(looks)} | {r.get('questions', '—')} | {r.get('flips', '—')} | "
              f"{cell(r['checks']['flip_rate']) if 'checks' in r else '—'} | "
              f"{cell(r['checks']['mean_kl'], 3) if 'checks' in r else '—'} | "
              f"{answers.get('source', '—')} ({answers.get('live', 0)} live) | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
