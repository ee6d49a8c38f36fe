"""Drift of the demo model's int8, fp8, int4 (groups 64 and 32) and nf4 variants against its BF16 reference, one report,
every figure with its 95% interval and the candidates compared pairwise (McNemar, paired bootstrap).

    python benchmarks/drift_demo.py --out /tmp/drift-demo                         # full: 500 rows, folds 16-19
    python benchmarks/drift_demo.py --b77-rows 40 --nlupp-rows 12 --out /tmp/drift-demo   # reduced (a 2-core CPU)
    python benchmarks/drift_demo.py --out /tmp/drift-demo --screenshot-only docs/drift_report.png  # README's PNG

Data: BANKING77 test rows 0…N (one 77-way choice each) and NLU++ banking folds (every ontology intent as a noul
question, 8 per request) as labelled JSONL, through ``clef-local drift`` with ``--floor`` (the reference in the
other compute dtype). Variants are made with ``clef-local quantize`` into ``--variants`` when missing. Prints the
drift table and the labelled-metrics table (the report's Markdown); writes report.html/.md/.json under ``--out``.
Tables in docs/benchmarks.md#drift-recalibration-eval.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from clef_local.data.convert import load_dataset, parse_folds
from clef_local.data.jsonl import write_jsonl
from clef_local.demo.default import default_model_path

# int4 names its group: plain int4 takes 32 on the demo (its weights lie on that grid, docs/quantization.md)
SCHEMES = ("int8", "fp8", "int4-g64", "int4-g32", "nf4")


def ensure_variants(reference: Path, directory: Path, schemes: list[str]) -> list[Path]:
    """``directory/demo-<scheme>`` for each scheme (``int4-g32``: int4 with ``--group-size 32``, likewise
    ``int4-g64``), exported with ``clef-local quantize`` when missing."""
    from clef_local.export.quantize import main as quantize_main

    paths = []
    for spec in schemes:
        scheme, _, group = spec.partition("-g")
        out = directory / f"demo-{spec}"
        if not out.is_dir():
            directory.mkdir(parents=True, exist_ok=True)
            sized = ["--group-size", group] if group else []
            code = quantize_main(["--model", str(reference), "--format", scheme, *sized, "--out", str(out),
                                  "--no-validate"])
            if code:
                raise SystemExit(f"quantize {spec} failed with exit code {code}")
        paths.append(out)
    return paths


def screenshot(report: Path, png: Path, width: int = 1400) -> None:
    """The top of ``report`` as a PNG, through Debian's chromium run headless by Playwright (as scripts/ui_load.py)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                             args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": width, "height": 1800})
        page.goto(report.resolve().as_uri())
        png.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(png))
        browser.close()
    print(f"screenshot of {report}: {png}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, help="BF16 reference (default: the demo model)")
    parser.add_argument("--variants", type=Path, default=Path.home() / ".cache" / "clef-local" / "variants",
                        help="where the demo-<scheme> variants are (made when missing)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated; int4-g32 = int4 group 32")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples of the intervals")
    parser.add_argument("--b77-rows", type=int, default=500, help="BANKING77 test rows from 0 (default 500)")
    parser.add_argument("--folds", default="16-19", help="NLU++ banking folds (default 16-19)")
    parser.add_argument("--nlupp-rows", type=int, help="first N utterances of those folds (default: all)")
    parser.add_argument("--dtype", default="float32", help="compute dtype of every model (default float32)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--no-floor", action="store_true",
                        help="skip the noise floor (the reference again in float32: the slowest model on a CPU)")
    parser.add_argument("--out", type=Path, required=True, help="output folder (data, report.html/.md/.json)")
    parser.add_argument("--screenshot-only", type=Path, metavar="PNG",
                        help="run nothing: screenshot --out's existing report.html into PNG")
    args = parser.parse_args(argv)
    if args.screenshot_only:
        screenshot(args.out / "report.html", args.screenshot_only)
        return 0
    reference = args.reference or default_model_path()
    variants = ensure_variants(reference, args.variants, args.schemes.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    examples = load_dataset("banking77", split="test", limit=args.b77_rows)
    examples += load_dataset("nlupp", folds=parse_folds(args.folds), limit=args.nlupp_rows)
    data = args.out / "drift_data.jsonl"
    write_jsonl(examples, data)
    questions = sum(len(e.request["questions"]) for e in examples)
    scope = (f"BANKING77 test rows 0-{args.b77_rows - 1} (77-way), NLU++ folds {args.folds} "
             f"{'all' if args.nlupp_rows is None else f'first {args.nlupp_rows}'} utterances")
    print(f"data: {scope}: {len(examples)} requests, {questions} questions → {data}", flush=True)
    from clef_local.quality.drift_cli import main as drift_main

    started = time.perf_counter()
    argv_drift = ["--reference", str(reference), *[a for v in variants for a in ("--candidate", str(v))],
                  "--data", str(data), *([] if args.no_floor else ["--floor"]),
                  "--dtype", args.dtype, "--batch-size", str(args.batch_size), "--resamples", str(args.resamples),
                  "--report", str(args.out / "report.html"), "--json", str(args.out / "report.json"),
                  "--md", str(args.out / "report.md")]
    print("clef-local drift " + " ".join(argv_drift), flush=True)
    code = drift_main(argv_drift)
    print(f"drift took {time.perf_counter() - started:.0f} s (exit {code}); scope: {scope}")
    return code


if __name__ == "__main__":
    sys.exit(main())
