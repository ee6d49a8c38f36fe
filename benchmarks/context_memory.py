"""Contexts to 64K: peak memory of one decision against its context length, in one pass and with chunked prefill,
next to what the planner counts at the same length (``clef-local plan --context N``), and the probabilities of the
two passes compared.

    python benchmarks/context_memory.py                                    # tiny Qwen3.5 release (64K context)
    python benchmarks/context_memory.py --model ~/.cache/clef-local/clef-demo-135m --lengths 2048,4096,8192

Each (length, pass) runs in a fresh process: it loads the model with ``max_length=N`` (``prefill_chunk=0`` for one
pass, ``--chunk`` for chunks), encodes a request of exactly N tokens (a long state cut to fit), decides a short
request to warm up, resets its peak RSS (``/proc/self/clear_refs``), runs the long one and reads ``VmHWM``, the
whole process's peak: Python, torch, the weights and the pass, what the planner's need counts (weights + activations +
the runtime's overhead + the margin). ``plan`` is that need for the same N, dtype and chunk length, on this CPU.
Table in docs/benchmarks.md#contexts-to-64k.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = r"""
import json, sys, time
from pathlib import Path
import numpy as np
import clef_local

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

model_dir, length, chunk, dtype, state_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
questions = json.loads(sys.argv[6])
model = clef_local.load(model_dir, dtype=dtype, max_length=length, state_cache=0, prefill_chunk=chunk)
record = model.encode({"model": "m", "state": Path(state_file).read_text(), "questions": questions},
                      truncate_state=True)
model.decide({"model": "m", "state": "warm up", "questions": questions})
calls = []
forward = model.backend.backbone.forward
model.backend.backbone.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
baseline = status("VmRSS")
started = time.perf_counter()
[(_, [prediction])] = model.run([record])
seconds = time.perf_counter() - started
print(json.dumps({"tokens": len(record.input_ids), "baseline": baseline, "peak": status("VmHWM"),
                  "seconds": seconds, "passes": len(calls),
                  "probabilities": [np.asarray(p, dtype=np.float64).tolist() for p in prediction.probabilities]}))
"""
QUESTIONS = {
    "intent": {"type": "choice", "instructions": "What does the customer want?",
               "criteria": {"refund": "Money back", "card": "A card problem", "other": None}},
    "urgent": {"type": "noul", "instructions": "Is it urgent?"},
    "tone": {"type": "score", "criteria": ["calm", "annoyed", "angry"]},
}
WORDS = (
    "the", "card", "was", "declined", "again", "at", "the", "store", "and", "nobody", "could", "tell", "me", "why",
    "so", "I", "called", "the", "bank", "twice", "refund", "my", "money", "please", "this", "is", "the", "third",
    "time", "my", "transfer", "failed", "the", "balance", "looks", "wrong", "Überweisung", "été", "转账", "😀",
)


def long_state(chars: int, seed: int = 0) -> str:
    """Random sentences of :data:`WORDS`, at least ``chars`` characters (more than the tokens they make)."""
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def measure(model: Path, length: int, chunk: int, dtype: str, state_file: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(length), str(chunk), dtype,
                           str(state_file), json.dumps(QUESTIONS)], capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def planned(model: Path, length: int, chunk: int, dtype: str) -> tuple[int, int]:
    """(the planner's need, its activations) for one record of ``length`` tokens on this CPU, in chunks of
    ``chunk`` tokens (0: one pass): ``plan --context N --dtype D`` for the stored format, every weight in this
    one memory pool."""
    from clef_local.formats.release import read_release
    from clef_local.planning.census import stored_format
    from clef_local.planning.estimate import plan
    from clef_local.planning.hardware import detect_cpu
    from clef_local.planning.planner import footprint_from_release

    footprint = footprint_from_release(model)
    census = footprint.censuses[stored_format(read_release(model).config)]
    p = plan(census, footprint.dims, detect_cpu(), context=length, dtype=dtype, media=True, chunk=chunk or None)
    return p.need, p.activations.total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a release (default: a tiny Qwen3.5 release, 64K context)")
    parser.add_argument("--lengths", default="4096,8192,16384,32768,65536", help="context lengths, comma-separated")
    parser.add_argument("--chunk", type=int, default=4096, help="chunk length of the chunked passes (default 4096)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    lengths = [int(n) for n in args.lengths.split(",")]
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from clef_local.testing import build_tiny_release

            model = build_tiny_release(Path(tmp) / "tiny-qwen3_5", backbone="qwen3_5")
        state_file = Path(tmp) / "state.txt"
        state_file.write_text(long_state(8 * max(lengths)))
        for length in lengths:
            results = {}
            for chunk in (0, args.chunk):
                results[chunk] = measure(model, length, chunk, args.dtype, state_file)
                need, acts = planned(model, length, chunk, args.dtype)
                results[chunk].update(need=need, acts=acts)
            one, chunked = results[0], results[args.chunk]
            dp = max(abs(a - b) for pa, pb in zip(one["probabilities"], chunked["probabilities"], strict=True)
                     for a, b in zip(pa, pb, strict=True))
            for chunk, r in results.items():
                rows.append({"length": length, "chunk": chunk, "dp": dp, **r})
    table = Table(title=f"{model.name}: one decision of N tokens, {args.dtype}, peak RSS of the process (MB) vs "
                        "the planner's need")
    for column in ("N", "tokens", "pass", "forwards", "baseline", "peak", "plan need", "plan / peak",
                   "plan activ.", "peak − baseline", "seconds", "max |Δp| chunked vs one"):
        table.add_column(column, justify="right")
    for r in rows:
        how = "one pass" if not r["chunk"] else f"{r['chunk']:,}-token chunks"
        table.add_row(f"{r['length']:,}", f"{r['tokens']:,}", how,
                      str(r["passes"]), f"{r['baseline'] / 1e6:.0f}", f"{r['peak'] / 1e6:.0f}",
                      f"{r['need'] / 1e6:.0f}", f"{r['need'] / r['peak']:.2f}", f"{r['acts'] / 1e6:.0f}",
                      f"{(r['peak'] - r['baseline']) / 1e6:.0f}", f"{r['seconds']:.1f}",
                      f"{r['dp']:.1e}" if r["chunk"] else "")
    Console(width=200).print(table)
    worst = max(abs(r["need"] / r["peak"] - 1) for r in rows)
    print(f"plan within {worst:.0%} of the measured peak at every length; total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
