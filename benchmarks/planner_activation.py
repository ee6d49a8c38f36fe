"""The planner's activation estimate against the measured peak RSS increase of a CPU decide (issue 5).

    python benchmarks/planner_activation.py                       # the demo model, 512 / 2,048 / 8,192 tokens
    python benchmarks/planner_activation.py --model DIR --tokens 1024 4096 --dtype bfloat16

Each size runs in a fresh subprocess: load the model, answer a short warm-up request (lazy imports, thread pools),
reset the kernel's peak-RSS mark (``/proc/self/clear_refs`` ← 5), read VmRSS, answer a 3-question request whose state
is padded to the target token count, read VmHWM. The increase (peak − before) is what the decide itself held at its
peak: the activations. glibc's mmap threshold is fixed (``MALLOC_MMAP_THRESHOLD_=65536``) so that freed tensors go
back to the kernel instead of a heap that the next tensor silently reuses. Linux only. Prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from clef_local.formats.release import read_release
from clef_local.planning.estimate import ModelDims, activations

_CHILD = r"""
import gc, json, sys
import clef_local
from clef_local.errors import MaxTokensExceededError

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

path, dtype, target = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = clef_local.load(path, dtype=dtype)
questions = {"complaint": {"type": "noul", "instructions": "Is the customer complaining?"},
             "topic": {"type": "choice", "criteria": {"cards": None, "transfers": None, "account": None}},
             "urgency": {"type": "score", "criteria": ["low", "medium", "high"]}}
def request(repeats):
    return {"model": "m", "state": " the card payment was declined again" * repeats, "questions": questions}
def tokens(repeats):
    try:
        return len(model.encode(request(repeats))[1].input_ids)
    except MaxTokensExceededError:
        return target + 1
lo, hi = 0, target
while lo < hi:  # the most repeats that stay within the target
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if tokens(mid) <= target else (lo, mid - 1)
model.decide(request(1))
gc.collect()
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")
before = status("VmRSS:")
model.decide(request(lo))
print(json.dumps({"tokens": tokens(lo), "before": before, "peak": status("VmHWM:")}))
"""


def measure(path: Path, dtype: str, target: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), dtype, str(target)], capture_output=True,
                         text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(f"measurement at {target} tokens failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="release directory (default: the demo model)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    if args.model is None:
        from clef_local.demo.default import default_model_path

        args.model = default_model_path()
    release = read_release(args.model)
    dims = ModelDims.from_config(release.config, head_width=release.head_config.width)
    print(f"{args.model.name}: {release.architecture}, {args.dtype}, batch 1, peak RSS increase of one decide")
    print("| tokens | estimate (MiB) | measured (MiB) | estimate / measured | dominant term |")
    print("|---:|---:|---:|---:|---|")
    for target in args.tokens:
        result = measure(args.model, args.dtype, target)
        estimate = activations(dims, result["tokens"], 1, args.dtype)
        measured = result["peak"] - result["before"]
        print(f"| {result['tokens']:,} | {estimate.total / 2**20:.1f} | {measured / 2**20:.1f} | "
              f"{estimate.total / measured:.2f} | {estimate.dominant} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
