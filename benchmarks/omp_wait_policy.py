"""torch's OpenMP threads with another process on a core: threads and ``OMP_WAIT_POLICY``, quiet and under load.

    python benchmarks/omp_wait_policy.py                      # every workload, setting and load
    python benchmarks/omp_wait_policy.py --workloads grid --repeats 5

Each cell runs in a fresh Python process (``OMP_NUM_THREADS`` and ``OMP_WAIT_POLICY`` are read once, when torch
loads its OpenMP runtime), one warm-up call, then the median of ``--repeats`` calls, in ms. Workloads:

- ``grid``: what ``quantize``'s export does per weight: the default int4 grid (``mse``, group 64) over 32 row chunks
  of [64, 4096] bf16 (``clef_local.export.shards.CHUNK_ELEMENTS`` each, 8 MB in all): thousands of small ops, each
  one OpenMP parallel region.
- ``matmul``: one [615, 4096] @ [4096, 12288] bf16 matmul (a 615-token prompt through a Clef-flash MLP weight): few,
  large parallel regions.

Loads: ``quiet``, or ``1 spinner`` (a Python process busy on one core for the whole cell). Settings: 1 thread; every
core with libgomp's default wait policy (threads spin at a barrier for a while before they sleep); every core with
``OMP_WAIT_POLICY=PASSIVE`` (they sleep at once). Table in docs/benchmarks.md#threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time
import torch
from clef_local.quant import int4

workload, repeats = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
if workload == "grid":
    chunks = [torch.randn(64, 4096).mul_(0.02).to(torch.bfloat16) for _ in range(32)]
    def run():
        for chunk in chunks:
            int4.quantize_values(chunk, 64, "mse")
else:
    x = torch.randn(615, 4096).to(torch.bfloat16)
    w = torch.randn(4096, 12288).mul_(0.02).to(torch.bfloat16)
    def run():
        x @ w
run()
times = []
for _ in range(repeats):
    started = time.perf_counter()
    run()
    times.append(1e3 * (time.perf_counter() - started))
print(json.dumps({"ms": statistics.median(times), "threads": torch.get_num_threads()}))
"""
SPIN = "while True: pass"
SETTINGS = {"1 thread": {"OMP_NUM_THREADS": "1"},
            "all cores, default wait": {},
            "all cores, PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}}


def cell(workload: str, setting: dict[str, str], load: int, repeats: int, cores: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env = {**env, "OMP_NUM_THREADS": str(cores), **setting}
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(load)]
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, workload, str(repeats)], env=env, check=True,
                              capture_output=True, text=True)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from clef_local.planning.hardware import physical_cores

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["grid", "matmul"], choices=["grid", "matmul"])
    parser.add_argument("--loads", nargs="+", type=int, default=[0, 1], help="spinning processes beside each cell")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cores = physical_cores()
    print(f"{cores} physical cores; median of {args.repeats} after one warm-up, ms", flush=True)
    print("| workload | load | " + " | ".join(SETTINGS) + " |")
    print("|---|---|" + "---:|" * len(SETTINGS))
    for workload in args.workloads:
        for load in args.loads:
            cells = [cell(workload, setting, load, args.repeats, cores) for setting in SETTINGS.values()]
            label = "quiet" if load == 0 else f"{load} spinner{'s' if load > 1 else ''}"
            print(f"| {workload} | {label} | " + " | ".join(f"{c['ms']:,.0f} ({c['threads']}t)" for c in cells)
                  + " |", flush=True)


if __name__ == "__main__":
    main()
