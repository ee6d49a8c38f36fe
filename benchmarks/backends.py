"""One 3-question request on the demo model through every backend available here, as ratios to torch float32.

    python benchmarks/backends.py                 # the demo model
    python benchmarks/backends.py --model DIR --repeats 5

Each row runs in its own subprocess (load, one warm-up decide); the timed decides are interleaved round by round
(median of ``--repeats``), so a load spike from other work on the machine hits every backend alike. MLX on Linux
gets Debian's OpenBLAS preloaded (``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0``,
docs/hardware.md, known traps: the mlx-cpu wheel's own BLAS is ~120× slower). Also prints each row's max |Δp| against
torch float32. Prints one table.
Table in docs/benchmarks.md#backends.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
THREE = {"model": "clef-local", "state": "My card payment was declined twice at the supermarket today.",
         "questions": {"complaint": {"type": "noul", "instructions": "Is the customer complaining?"},
                       "topic": {"type": "choice", "criteria": {"cards": None, "transfers": None, "account": None}},
                       "urgency": {"type": "score", "criteria": ["low", "medium", "high"]}}}
ROWS = (("torch", "float32"), ("torch", "bfloat16"), ("mlx", "float32"))
_CHILD = r"""
import json, sys, time
import clef_local
path, backend, dtype, request = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
model = clef_local.load(path, backend=backend, dtype=dtype, device="cpu")
prediction = model.predict([request])[0]  # the warm-up, and the probabilities compared across backends
print(json.dumps({"tokens": len(prediction.encoded.input_ids),
                  "p": [list(map(float, p)) for p in prediction.probabilities]}), flush=True)
for _ in sys.stdin:  # one decide per line, so the parent can interleave backends round by round
    started = time.perf_counter()
    model.decide(request)
    print(json.dumps({"ms": 1e3 * (time.perf_counter() - started)}), flush=True)
"""


def start(path: Path, backend: str, dtype: str) -> subprocess.Popen | str:
    """A child process with the model loaded, or why it cannot run."""
    env = dict(os.environ)
    if backend == "mlx" and platform.system() == "Linux":
        if not OPENBLAS.is_file():
            return f"skipped: {OPENBLAS} missing (apt-get install libopenblas0-pthread)"
        env["LD_PRELOAD"] = str(OPENBLAS)
    # stderr is dropped, not piped: a chatty child (progress bars, warnings) would block on a full pipe
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(path), backend, dtype, json.dumps(THREE)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)


def read(child: subprocess.Popen) -> dict | str:
    line = child.stdout.readline() if child.stdout else ""
    if not line:
        child.wait()
        return f"failed (exit {child.returncode}); run the backend alone to see why"
    return json.loads(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="release directory (default: the demo model)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.model is None:
        from clef_local.demo.default import default_model_path

        args.model = default_model_path()
    children: dict[tuple[str, str], subprocess.Popen] = {}
    results: dict[tuple[str, str], dict | str] = {}
    for backend, dtype in ROWS:
        module = {"torch": "clef_local.backends.torch_backend", "mlx": "clef_local.backends.mlx_backend"}[backend]
        if importlib.util.find_spec(backend) is None or importlib.util.find_spec(module) is None:
            results[(backend, dtype)] = f"skipped: {backend} or {module} is not installed"
            continue
        child = start(args.model, backend, dtype)
        if isinstance(child, str):
            results[(backend, dtype)] = child
        else:
            children[(backend, dtype)] = child
    for key, child in children.items():  # loaded concurrently; each reports after its warm-up
        results[key] = read(child)
    live = {k: c for k, c in children.items() if isinstance(results[k], dict)}
    times: dict[tuple[str, str], list[float]] = {k: [] for k in live}
    for _ in range(args.repeats):  # round robin: a load spike from elsewhere hits every backend alike
        for key, child in live.items():
            child.stdin.write("go\n")
            child.stdin.flush()
            answer = read(child)
            if isinstance(answer, str):
                raise SystemExit(f"{key}: {answer}")
            times[key].append(answer["ms"])
    for key, child in children.items():
        child.stdin.close()
        child.wait()
        if key in times:
            results[key]["ms"] = statistics.median(times[key])
    reference = results[("torch", "float32")]
    if not isinstance(reference, dict):
        raise SystemExit(f"torch float32 is the reference and it {reference}")
    print(f"{args.model.name}, 3-question request ({reference['tokens']} tokens), CPU, median of {args.repeats} "
          "after one warm-up, each backend in its own process, interleaved round by round")
    print("| backend | dtype | ms | × torch float32 | max abs Δp vs torch float32 |")
    print("|---|---|---:|---:|---:|")
    for (backend, dtype), result in results.items():
        if isinstance(result, str):
            print(f"| {backend} | {dtype} | {result} | | |")
            continue
        delta = max(abs(a - b) for q, r in zip(result["p"], reference["p"], strict=True)
                    for a, b in zip(q, r, strict=True))
        print(f"| {backend} | {dtype} | {result['ms']:.0f} | {result['ms'] / reference['ms']:.2f} | {delta:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
