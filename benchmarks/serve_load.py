"""``clef-local serve`` under load: throughput and latency at concurrency 1, 4, 8, batching on vs off, per thread
setting, with or without a competing load.

    python benchmarks/serve_load.py                       # the default model, 80 requests per level
    python benchmarks/serve_load.py --model DIR --requests 200 --seconds 30
    python benchmarks/serve_load.py --threads 2,auto --load 0,1 --modes on --levels 1,4 --requests 24

``--threads`` lists settings to compare: ``auto`` is the server's own rule
(:func:`clef_local.planning.hardware.thread_plan`), a number N is ``CLEF_LOCAL_THREADS=N`` for the server and
``torch.set_num_threads(N)`` for direct (torch's own default is one thread per physical core). ``--load K`` starts
K competing processes, each spinning on one core (pinned to core i mod cores) for the whole measurement: the
situation of a server on a machine that also runs other work.

For each mode the real CLI server runs in its own process on a free loopback port (``--max-batch 8 --max-wait-ms
5`` for "on", ``--max-batch 1 --max-wait-ms 0`` for "off"); client threads, each with a keep-alive connection,
send the built-in example requests (triage, moderation, routing) round-robin. Each level sends ``--requests``
requests or stops after ``--seconds``, whichever comes first (bounded, loopback only). "direct" is
``model.decide`` in this process on the same requests, one at a time: the difference at concurrency 1 is the
HTTP overhead (JSON, the event loop, the scheduler's hand-off to its thread and, with batching on, up to
``--max-wait-ms`` of waiting for company). Mean batch sizes come from the server's ``/metrics``.
Tables in docs/benchmarks.md#serving and docs/benchmarks.md#threads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

import clef_local
from clef_local.demo.default import default_model_path
from clef_local.planning.hardware import physical_cores, thread_plan

EXAMPLES = ("triage", "moderation", "routing")
LEVELS = (1, 4, 8)
MODES = {"off": ["--max-batch", "1", "--max-wait-ms", "0"], "on": ["--max-batch", "8", "--max-wait-ms", "5"]}


def examples() -> list[dict[str, Any]]:
    files = resources.files("clef_local.demo.examples")
    return [{**json.loads(files.joinpath(f"{name}.json").read_text()), "model": "clef-local"} for name in EXAMPLES]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


@contextlib.contextmanager
def competing_load(processes: int) -> Iterator[None]:
    """``processes`` busy loops, each pinned to one core, for the duration of the block."""
    cpus = sorted(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN, str(cpus[i % len(cpus)])]) for i in range(processes)]
    try:
        time.sleep(0.5 if spinners else 0)
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def start_server(model: Path, mode: str, log: Path, threads: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "clef_local.cli", "serve", "--model", f"clef-local={model}",
               "--port", str(port), "--max-queue", "256", *MODES[mode]]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "CLEF_LOCAL_THREADS")}
    if threads != "auto":
        env["CLEF_LOCAL_THREADS"] = threads
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("the server did not start in 300 s")


def batch_stats(url: str) -> tuple[float, float]:
    """(sum, count) of the server's batch-size histogram."""
    text = httpx.get(url + "/metrics", timeout=30).text
    total = float(re.search(r"^clef_batch_size_sum (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
    count = float(re.search(r"^clef_batch_size_count (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
    return total, count


def run_level(url: str, requests: list[dict[str, Any]], concurrency: int, count: int,
              seconds: float) -> dict[str, float]:
    """``count`` requests from ``concurrency`` threads (or fewer if ``seconds`` run out)."""
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    next_index = [0]
    deadline = [0.0]  # set after the warm-up, which may itself take long on a loaded machine

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=300) as http:
            while time.monotonic() < deadline[0]:
                with lock:
                    i = next_index[0]
                    if i >= count:
                        return
                    next_index[0] += 1
                started = time.perf_counter()
                response = http.post("/v1/systemone", json=requests[i % len(requests)])
                elapsed = time.perf_counter() - started
                with lock:
                    latencies.append(elapsed)
                    errors[0] += response.status_code != 200

    for request in requests:  # warm-up: every request shape once
        httpx.post(url + "/v1/systemone", json=request, timeout=300)
    before = batch_stats(url)
    started = time.perf_counter()
    deadline[0] = time.monotonic() + seconds
    workers = [threading.Thread(target=worker) for _ in range(concurrency)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - started
    after = batch_stats(url)
    return {**summary(latencies, wall), "batch": (after[0] - before[0]) / max(after[1] - before[1], 1),
            "errors": errors[0]}


def summary(latencies: list[float], wall: float) -> dict[str, float]:
    """Count, throughput, p50 and p99 in ms (NaN for no request at all)."""
    latencies = sorted(latencies)
    if not latencies:
        return {"n": 0, "rps": 0.0, "p50": float("nan"), "p99": float("nan")}
    return {"n": len(latencies), "rps": len(latencies) / wall, "p50": 1e3 * statistics.median(latencies),
            "p99": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}


def direct(model_path: Path, requests: list[dict[str, Any]], count: int, seconds: float,
           threads: str) -> dict[str, float]:
    import torch

    torch.set_num_threads(thread_plan().intra_op if threads == "auto" else int(threads))
    model = clef_local.load(model_path)
    for request in requests:
        model.decide(request)
    latencies = []
    deadline = time.monotonic() + seconds
    started = time.perf_counter()
    for i in range(count):
        if time.monotonic() > deadline:
            break
        t = time.perf_counter()
        model.decide(requests[i % len(requests)])
        latencies.append(time.perf_counter() - t)
    wall = time.perf_counter() - started
    return {**summary(latencies, wall), "batch": 1.0, "errors": 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="release directory (default: the default model)")
    parser.add_argument("--requests", type=int, default=80, help="requests per level (default 80)")
    parser.add_argument("--seconds", type=float, default=30.0, help="time bound per level (default 30)")
    parser.add_argument("--threads", default="auto",
                        help="comma-separated thread settings to compare: auto (the server's rule) or N (default "
                             "auto)")
    parser.add_argument("--load", default="0", help="comma-separated numbers of competing spinning processes")
    parser.add_argument("--modes", default="off,on", help="batching modes: off, on or both (default off,on)")
    parser.add_argument("--levels", default="1,4,8", help="client counts (default 1,4,8)")
    parser.add_argument("--no-direct", action="store_true", help="skip the in-process direct decide rows")
    args = parser.parse_args(argv)
    model = args.model or default_model_path()
    requests = examples()
    settings = args.threads.split(",")
    loads = [int(n) for n in args.load.split(",")]
    modes = args.modes.split(",")
    levels = [int(n) for n in args.levels.split(",")]
    for setting in settings:
        if setting != "auto" and not setting.isdigit():
            parser.error(f"--threads: {setting!r} is neither auto nor a number")
    import torch

    print(f"model {model}; {os.cpu_count()} CPUs, {physical_cores()} physical cores usable; torch's default: "
          f"{torch.get_num_threads()} threads; auto = {thread_plan().intra_op}; {args.requests} requests per level, "
          f"at most {args.seconds:g} s; load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    rows: list[tuple[str, int, str, int, dict[str, float]]] = []

    def add(setting: str, load: int, mode: str, level: int, result: dict[str, float]) -> None:
        rows.append((setting, load, mode, level, result))
        print(f"  threads {setting}, load {load}, {mode}, {level} client(s): {result['n']:.0f} requests, "
              f"p50 {result['p50']:.0f} ms", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for load in loads:
            with competing_load(load):
                for setting in settings:
                    if not args.no_direct:
                        add(setting, load, "direct", 1, direct(model, requests, args.requests, args.seconds, setting))
                    for mode in modes:
                        process, url = start_server(model, mode, Path(tmp) / f"{mode}.log", setting)
                        try:
                            for level in levels:
                                add(setting, load, f"batching {mode}", level,
                                    run_level(url, requests, level, args.requests, args.seconds))
                        finally:
                            process.send_signal(signal.SIGTERM)
                            process.wait(60)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"\n{'threads':>7} {'load':>4} {'mode':<13} {'clients':>7} {'requests':>8} {'req/s':>8} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'mean batch':>10} {'errors':>6}")
    for setting, load, mode, level, r in rows:
        print(f"{setting:>7} {load:>4} {mode:<13} {level:>7} {r['n']:>8.0f} {r['rps']:>8.2f} {r['p50']:>8.1f} "
              f"{r['p99']:>8.1f} {r['batch']:>10.2f} {r['errors']:>6.0f}")
    by = {(setting, load, mode, level): r for setting, load, mode, level, r in rows}
    if len(settings) > 1:
        base = settings[0]
        print(f"\np50 latency of each setting / {base}'s (below 1: faster than {base}):")
        for (setting, load, mode, level), r in by.items():
            if setting != base and (base, load, mode, level) in by:
                print(f"  threads {setting}, load {load}, {mode}, {level} client(s): "
                      f"{r['p50'] / by[(base, load, mode, level)]['p50']:.2f}")
    for setting in settings:
        for load in loads:
            on, off = by.get((setting, load, "batching on", 8)), by.get((setting, load, "batching off", 8))
            if on and off:
                print(f"threads {setting}, load {load}: throughput at 8 clients, batching on / off: "
                      f"{on['rps'] / off['rps']:.2f}x")
            for mode in modes:
                served, alone = by.get((setting, load, f"batching {mode}", 1)), by.get((setting, load, "direct", 1))
                if served and alone:
                    print(f"threads {setting}, load {load}: HTTP overhead at 1 client (p50 - direct p50), batching "
                          f"{mode}: {served['p50'] - alone['p50']:+.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
