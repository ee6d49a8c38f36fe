"""Rows/s of ``clef-local batch`` on BANKING77 rows: the batch job against a loop of ``decide``, and ``--ray`` with 1
and 2 replicas on this machine.

    python benchmarks/batch_throughput.py                          # 1,000 BANKING77 test rows, 77-way, demo model
    python benchmarks/batch_throughput.py --rows 32 --k 8          # reduced (a busy 2-core CPU)

One JSONL of BANKING77 test rows (``clef-local data convert``'s requests: one 77-way choice, or ``--k``-way); the
model is loaded once for the loop of ``ClefModel.decide`` and the local batch job (load time excluded from both);
the Ray runs start a local cluster (``--ray local``) and include its start and each replica's model load, as a
user's job does. Prints one table and the ratios, with the core count and torch threads.
Table in docs/benchmarks.md#batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import clef_local
from clef_local.batch.io import InputSpec
from clef_local.batch.job import BatchJob, run_batch
from clef_local.batch.ray_runner import RaySettings
from clef_local.batch.work import ChunkSettings
from clef_local.data.convert import load_dataset
from clef_local.demo.default import default_model_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="release (default: the demo model)")
    parser.add_argument("--rows", type=int, default=1000, help="BANKING77 test rows, spread over the split")
    parser.add_argument("--k", type=int, help="k-way choices (default: 77-way)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the loop and the local job (default 1: two threads on a shared "
                             "2-core machine oversubscribe it)")
    parser.add_argument("--chunk-rows", type=int, default=64)
    parser.add_argument("--replicas", default="1,2", help="Ray runs (replica counts; empty: none)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    model_dir = args.model or default_model_path()
    examples = load_dataset("banking77", split="test", k=args.k)
    examples = [examples[i * len(examples) // args.rows] for i in range(min(args.rows, len(examples)))]
    requests = [e.request for e in examples]
    folder = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    source = folder / "b77.jsonl"
    source.write_text("".join(json.dumps({"id": e.id, **e.request}) + "\n" for e in examples), encoding="utf-8")
    model = clef_local.load(model_dir, dtype=args.dtype)
    tokens = sum(len(model.encode(r).input_ids) for r in requests)
    model.decide(requests[0])  # warm-up
    rows: list[tuple[str, float]] = []

    def report(name: str, seconds: float) -> None:  # each run as it ends, so a stopped benchmark keeps its numbers
        rows.append((name, seconds))
        print(f"{name}: {seconds:.1f} s, {len(requests) / seconds:.3f} rows/s", file=sys.stderr, flush=True)

    started = time.perf_counter()
    for request in requests:
        model.decide(request)
    report("loop of `ClefModel.decide`", time.perf_counter() - started)

    def job(out: str, ray: RaySettings | None) -> BatchJob:
        return BatchJob(model=model_dir, input=InputSpec(source, "jsonl"), out=folder / out,
                        chunk_rows=args.chunk_rows, settings=ChunkSettings(), load_options={"dtype": args.dtype},
                        force=True, ray=ray, progress=False)

    started = time.perf_counter()
    summary = run_batch(job("local.jsonl", None), model=model)
    report("`batch` (one process)", time.perf_counter() - started)
    assert summary.answered == len(requests), summary.text()
    del model
    for replicas in [int(r) for r in args.replicas.split(",") if r]:
        started = time.perf_counter()
        summary = run_batch(job(f"ray{replicas}.jsonl", RaySettings("local", replicas=replicas)))
        report(f"`batch --ray local --replicas {replicas}`", time.perf_counter() - started)
        assert summary.answered == len(requests), summary.text()
        same = (folder / f"ray{replicas}.jsonl").read_bytes() == (folder / "local.jsonl").read_bytes()
        print(f"ray {replicas} replica(s): output {'identical to' if same else 'DIFFERS from'} the local job's",
              file=sys.stderr)
    kind = f"{args.k}-way" if args.k else "77-way"
    print(f"model {model_dir} ({args.dtype}), {len(requests)} BANKING77 test rows ({kind}), {tokens} tokens; "
          f"{os.cpu_count()} CPU cores, torch {args.threads} thread(s) in the loop and the local job")
    print("| run | seconds | rows/s |\n|---|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.1f} | {len(requests) / seconds:.3f} |")
    speed = {name: len(requests) / seconds for name, seconds in rows}
    print(f"batch / loop of decide: {speed['`batch` (one process)'] / speed['loop of `ClefModel.decide`']:.2f}×")
    ray = {name: value for name, value in speed.items() if "--replicas 1`" in name or "--replicas 2`" in name}
    if len(ray) == 2:
        one, two = (speed[f"`batch --ray local --replicas {n}`"] for n in (1, 2))
        print(f"Ray 2 replicas / 1 replica: {two / one:.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
