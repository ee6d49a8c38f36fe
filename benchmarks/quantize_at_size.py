"""``clef-local quantize`` of a full-size release on this machine: the default ``--bits 4`` end to end, then
``--bits 8`` of the same release reusing the reference answers the first run kept (``--bits 8`` alone: int8 with its
reference run live).

    python benchmarks/synthetic_release.py --config clef-flash --scheme bf16 --out /data/flash-bf16
    python benchmarks/quantize_at_size.py --model /data/flash-bf16 --work /data/q --max-memory cpu=6GiB

Each quantize runs as the console script in a fresh process (``clef-local quantize --model MODEL --out OUT ...
--max-memory CAP``) with a private user cache (``CLEF_LOCAL_CACHE=WORK/cache``, emptied first, so the first run
computes the reference and the second finds it): wall time, the child's peak RSS (``os.wait4``), exit status and
verdict, and from ``validation.json`` (the variant's, or the refused report the error names) each model's pass:
probes, tokens, seconds, and GFLOP/s = 2 · tokens · the decoder layers' linear weights (from the headers, as
``cpu_decide.py`` counts them: attention and the gated delta net's recurrence left out, so a lower bound) as a share
of this CPU's BF16 peak measured in the same run (``cpu_decide.py``'s dense matmul). Random weights are refused, and
should be: the table says after how many probes. ``--no-validate`` adds a row for the grid alone (``--bits 4
--no-validate``). Table in docs/benchmarks.md#quantize-at-full-size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from _timing import run_child
from cpu_decide import PEAK, linear_weights

from clef_local.units import GiB


def run_quantize(model: Path, out: Path, cache: Path, flags: list[str]) -> dict[str, Any]:
    """One ``clef-local quantize`` in a fresh process: wall, peak RSS, exit status, its stderr's error line."""
    env = {**os.environ, "CLEF_LOCAL_CACHE": str(cache)}
    command = [sys.executable, "-m", "clef_local.cli", "quantize", "--model", str(model), "--out", str(out), *flags]
    print("$", " ".join(command), file=sys.stderr, flush=True)
    log = out.with_name(out.name + ".log")
    with log.open("w") as sink:
        run = run_child(command, env=env, stderr=sink)
    stderr = log.read_text()
    sys.stderr.write(stderr[-4000:])
    error = next((line for line in stderr.splitlines() if line.startswith("error:")), "")
    return {"flags": " ".join(flags), "code": run.code, "wall_s": run.wall_s, "error": error,
            "peak_rss": run.peak_rss, "stderr": stderr}


def validation_of(out: Path, error: str) -> dict[str, Any] | None:
    """The variant's validation.json, or the refused report the error line names."""
    candidates = [out / "validation.json"]
    candidates += [Path(m) for m in re.findall(r"(/\S+?validation\.json)", error)]
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text())
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a BF16 release (benchmarks/synthetic_release.py)")
    parser.add_argument("--work", type=Path, required=True, help="a folder for the variants and the private cache")
    parser.add_argument("--max-memory", default="cpu=6GiB")
    parser.add_argument("--no-validate", action="store_true", help="add a --bits 4 --no-validate row (the grid)")
    parser.add_argument("--bits", nargs="+", default=["4", "8"], choices=["4", "8"],
                        help="the validated runs, in order (the first computes the reference; `--bits 8` alone: "
                             "int8 with its reference live)")
    args = parser.parse_args()
    linears, hidden, intermediate = linear_weights(args.model)
    peak = json.loads(subprocess.run([sys.executable, "-c", PEAK, "512", str(hidden), str(intermediate)],
                                     capture_output=True, text=True, check=True).stdout)
    cache = args.work / "cache"
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    runs = []
    plan = [["--bits", bits, "--max-memory", args.max_memory] for bits in args.bits]
    if args.no_validate:
        plan.insert(0, ["--bits", "4", "--no-validate"])
    for n, flags in enumerate(plan):
        out = args.work / f"variant-{n}"
        row = run_quantize(args.model, out, cache, flags)
        row["validation"] = validation_of(out, row["error"])
        runs.append(row)
        shutil.rmtree(out, ignore_errors=True)
    print(f"BF16 peak {peak['gflops']:.0f} GFLOP/s ({peak['threads']} threads, [512, {hidden}] @ [{hidden}, "
          f"{intermediate}]); {linears / 1e9:.2f} G decoder linear weights")
    print("| command | exit | wall s | peak RSS GiB | verdict | probes used | model | probes | tokens | loads | "
          "pass s | GFLOP/s | share of BF16 peak |")
    print("|---|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for row in runs:
        v = row["validation"] or {}
        head = (f"| quantize {row['flags']} | {row['code']} | {row['wall_s']:.0f} | "
                f"{(row['peak_rss'] or 0) / GiB:.2f} | {v.get('verdict', '—')} | {v.get('requests', '—')} |")
        passes = (v.get("runs") or {}).items()
        if not passes:
            print(head + " — | | | | | | |")
        for role, p in passes:
            rate = 2 * p.get("tokens", 0) * linears / p["seconds"] / 1e9 if p.get("seconds") else 0.0
            print(f"{head} {role} | {p.get('requests', 0)} | {p.get('tokens', 0)} | {p.get('loads', 0)} | "
                  f"{p['seconds']:.0f} | {rate:.0f} | {rate / peak['gflops']:.0%} |")
        if v.get("reference_answers"):
            print(f"|  |  |  |  |  | reference answers: {json.dumps(v['reference_answers'])} | | | | | | | |")
    (args.work / "runs.json").write_text(json.dumps({"peak": peak, "linears": linears, "runs": [
        {k: v for k, v in r.items() if k != "stderr"} for r in runs]}, indent=2))


if __name__ == "__main__":
    main()
