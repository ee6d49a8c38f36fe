"""``clef-local serve`` under load: throughput and latency at concurrency 1, 4, 8, batching on vs off.

    python benchmarks/serve_load.py                       # the default model, 80 requests per level
    python benchmarks/serve_load.py --model DIR --requests 200 --seconds 30

For each mode the real CLI server runs in its own process on a free loopback port (``--max-batch 8 --max-wait-ms
5`` for "on", ``--max-batch 1 --max-wait-ms 0`` for "off"); client threads, each with a keep-alive connection,
send the built-in example requests (triage, moderation, routing) round-robin. Each level sends ``--requests``
requests or stops after ``--seconds``, whichever comes first (bounded, loopback only). "direct" is
``model.decide`` in this process on the same requests, one at a time: the difference at concurrency 1 is the
HTTP overhead (JSON, the event loop, the scheduler's hand-off to its thread and, with batching on, up to
``--max-wait-ms`` of waiting for company). Mean batch sizes come from the server's ``/metrics``.
"""

from __future__ import annotations

import argparse
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
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

import clef_local
from clef_local.demo.default import default_model_path

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


def start_server(model: Path, mode: str, log: Path, threads: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "clef_local.cli", "serve", "--model", f"clef-local={model}",
               "--port", str(port), "--max-queue", "256", *MODES[mode]]
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
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
    deadline = time.monotonic() + seconds

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=300) as http:
            while time.monotonic() < deadline:
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
    workers = [threading.Thread(target=worker) for _ in range(concurrency)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - started
    after = batch_stats(url)
    latencies.sort()
    return {"n": len(latencies), "rps": len(latencies) / wall, "p50": 1e3 * statistics.median(latencies),
            "p99": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "batch": (after[0] - before[0]) / max(after[1] - before[1], 1), "errors": errors[0]}


def direct(model_path: Path, requests: list[dict[str, Any]], count: int, seconds: float,
           threads: int | None) -> dict[str, float]:
    import torch

    if threads:
        torch.set_num_threads(threads)
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
    latencies.sort()
    return {"n": len(latencies), "rps": len(latencies) / wall, "p50": 1e3 * statistics.median(latencies),
            "p99": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], "batch": 1.0, "errors": 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="release directory (default: the default model)")
    parser.add_argument("--requests", type=int, default=80, help="requests per level (default 80)")
    parser.add_argument("--seconds", type=float, default=30.0, help="time bound per level (default 30)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads, in the server (OMP_NUM_THREADS) and for direct (default 1: on a small "
                             "machine the client threads need the other cores, and oversubscribed OpenMP threads "
                             "make forwards erratic)")
    args = parser.parse_args(argv)
    model = args.model or default_model_path()
    requests = examples()
    print(f"model {model}; {os.cpu_count()} CPUs; torch threads: {args.threads or 'default'}; "
          f"{args.requests} requests per level, at most {args.seconds:g} s")
    rows: list[tuple[str, int, dict[str, float]]] = [
        ("direct", 1, direct(model, requests, args.requests, args.seconds, args.threads))]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            process, url = start_server(model, mode, Path(tmp) / f"{mode}.log", args.threads)
            try:
                for level in LEVELS:
                    rows.append((f"batching {mode}", level,
                                 run_level(url, requests, level, args.requests, args.seconds)))
            finally:
                process.send_signal(signal.SIGTERM)
                process.wait(60)
    print(f"\n{'mode':<13} {'clients':>7} {'requests':>8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'mean batch':>10} {'errors':>6}")
    for mode, level, r in rows:
        print(f"{mode:<13} {level:>7} {r['n']:>8.0f} {r['rps']:>8.1f} {r['p50']:>8.1f} {r['p99']:>8.1f} "
              f"{r['batch']:>10.2f} {r['errors']:>6.0f}")
    by = {(mode, level): r for mode, level, r in rows}
    speedup = by[("batching on", 8)]["rps"] / by[("batching off", 8)]["rps"]
    print(f"\nthroughput at 8 clients, batching on / off: {speedup:.2f}x")
    for mode in MODES:
        overhead = by[(f"batching {mode}", 1)]["p50"] - by[("direct", 1)]["p50"]
        print(f"HTTP overhead at 1 client (p50 - direct p50), batching {mode}: {overhead:+.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
