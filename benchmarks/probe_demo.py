"""``clef-local probe`` on the demo model and on a tiny random release, and the seeded fault caught.

    python benchmarks/probe_demo.py                      # 64 probe requests, 1000 resamples
    python benchmarks/probe_demo.py --requests 32        # shorter

Prints one table per model (every check: requests and questions it changed, mean |Δp|, KL and flipped share with
their 95% intervals) for the demo model (``--dtype``, float32 by default), a tiny random Llama release, and the demo
model behind :class:`clef_local.testing.ListedOrderFault` (a backend that reads a choice's options in the order they
are listed): the option-order check is the one that must catch it. Tables in docs/benchmarks.md#probe.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from clef_local.data.probes import probe_requests
from clef_local.demo.default import default_model_path
from clef_local.quality.intervals import IntervalSettings
from clef_local.quality.probe import run_probe
from clef_local.quality.report import markdown_table, probe_table_rows


def _table(title: str, model, requests, settings: IntervalSettings, seed: int) -> None:
    started = time.perf_counter()
    result = run_probe(model, requests, settings=settings, seed=seed)
    print(f"\n{title} ({len(requests)} requests, {time.perf_counter() - started:.0f} s)\n", flush=True)
    print(markdown_table(probe_table_rows(result)), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="the release to probe (default: the demo model)")
    parser.add_argument("--requests", type=int, default=64, help="probe requests (default 64)")
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="the probed model's compute dtype (default float32)")
    args = parser.parse_args(argv)
    import clef_local
    from clef_local.testing import ListedOrderFault, build_tiny_release

    settings = IntervalSettings(resamples=args.resamples, seed=args.seed)
    requests = probe_requests(args.requests, args.seed)
    path = args.model or default_model_path()
    model = clef_local.load(path, dtype=args.dtype)
    _table(f"{Path(path).name} ({args.dtype})", model, requests, settings, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_release(Path(tmp) / "tiny-llama", backbone="llama", seed=1)
        _table("tiny random Llama release (float32)", clef_local.load(tiny, dtype="float32"), requests, settings,
               args.seed)
    model.backend = ListedOrderFault(model.backend)
    _table(f"{Path(path).name} behind ListedOrderFault (options read in the listed order)", model, requests,
           settings, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
