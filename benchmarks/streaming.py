"""Streamed execution: peak RSS, bytes read and time per pass of a release streamed from disk under a memory cap, and
``drift`` / ``quantize``'s validation run streamed (docs/hardware.md#streamed-from-disk).

    python benchmarks/streaming.py --model DIR --max-memory cpu=6GiB --requests 4
    python benchmarks/streaming.py --model DIR --max-memory cpu=1GiB --resident          # + resident, max |Δp|
    python benchmarks/streaming.py --model BF16 --candidate INT4 --max-memory cpu=6GiB --drift --quantize OUT

Each run is a fresh subprocess; its peak RSS is the kernel's high-water mark of that process (``VmHWM``, read while it
runs: a child's ``ru_maxrss`` would carry this parent's), torch and Python included. ``stream`` loads ``--model`` with
``offload="disk"`` under ``--max-memory`` and predicts ``--requests`` probe requests (the planner's batch budget decides
how many passes); ``resident`` the same without streaming (no cap) and the largest |Δp| between the two; ``drift`` runs
``clef-local drift --reference MODEL --candidate CANDIDATE --limit N`` under the cap (the reference streams by itself
when it does not fit); ``quantize`` runs ``clef-local quantize --model MODEL --bits 4 --out OUT`` under the cap (its
validation streams the reference and the variant when they do not fit: one row each, from ``validation.json``).
``--no-stream`` skips the first run. Prints one Markdown table. Numbers in docs/benchmarks.md#streamed-from-disk.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_CHILD = r"""
import json, sys, time
import numpy as np
import clef_local
from clef_local.data.probes import probe_requests

path, options, n, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
started = time.perf_counter()
model = clef_local.load(path, state_cache=0, **options)
loaded = time.perf_counter() - started
seconds = []
predictions = model.predict(probe_requests(n), batch_seconds=seconds)
np.savez(out, *[p for prediction in predictions for p in prediction.probabilities])
info = model.describe()
print(json.dumps({"load_s": loaded, "batch_s": seconds, "streamed": info.get("streamed"),
                  "loader": info["loader"]}))
"""


def _high_water(pid: int) -> int:
    """``pid``'s peak resident set so far (bytes; VmHWM), 0 once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _run(command: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout + stderr) of ``command`` in a subprocess; its stderr is printed too."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        peak = 0
        while process.poll() is None:
            peak = max(peak, _high_water(process.pid))
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        text, logged = out.read(), err.read()
    print(logged, file=sys.stderr, end="")
    text = text + logged
    if process.returncode not in (0, 1):  # drift exits 1 when a gate fails: still a measurement
        raise SystemExit(f"{' '.join(command)} failed with exit status {process.returncode}")
    return time.perf_counter() - started, peak, text


def _predict(model: Path, options: dict[str, Any], n: int, out: Path) -> tuple[float, int, dict[str, Any]]:
    wall, peak, text = _run([sys.executable, "-c", _CHILD, str(model), json.dumps(options), str(n), str(out)])
    return wall, peak, json.loads(text.strip().splitlines()[-1])


def _gib(n: float | None) -> str:
    return "—" if n is None else f"{n / (1 << 30):.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the release to stream (the reference)")
    parser.add_argument("--candidate", type=Path, help="a variant of it, for --drift")
    parser.add_argument("--max-memory", default="cpu=6GiB", help="the cap (default cpu=6GiB)")
    parser.add_argument("--requests", type=int, default=4, help="probe requests per run (default 4)")
    parser.add_argument("--dtype", default="auto", help="compute dtype (default auto)")
    parser.add_argument("--max-length", type=int,
                        help="the context the load plans for (default: the model's, 65,536; a streamed pass is not "
                             "chunked, so its activations grow with it)")
    parser.add_argument("--no-stream", action="store_true", help="skip the streamed prediction run")
    parser.add_argument("--resident", action="store_true", help="also run resident (no cap) and compare")
    parser.add_argument("--drift", action="store_true", help="also run clef-local drift under the cap")
    parser.add_argument("--quantize", type=Path, metavar="OUT", help="also run clef-local quantize --bits 4 to OUT")
    parser.add_argument("--int4-grid", choices=["mse", "mlx"],
                        help="--quantize: the int4 grid (default quantize's, mse; mlx is one pass, far quicker)")
    parser.add_argument("--validation-requests", type=int, metavar="N",
                        help="--quantize: probe requests its validation runs (default: quantize's, 64)")
    args = parser.parse_args(argv)
    dtype = None if args.dtype == "auto" else args.dtype
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        options = {"dtype": dtype, "offload": "disk", "max_memory": args.max_memory,
                   **({"max_length": args.max_length} if args.max_length else {})}
        if not args.no_stream:
            wall, peak, info = _predict(args.model, options, args.requests, Path(tmp) / "stream.npz")
            stream, streamed = info["loader"]["stream"], info["streamed"]
            passes = len(info["batch_s"])
            rows.append(["stream", peak, stream["peak_bytes"], streamed["bytes_read"], passes,
                         sum(info["batch_s"]) / passes, streamed["read_seconds"], streamed["wait_seconds"],
                         f"load {info['load_s']:.1f} s, {info['loader']['dtype']}, batch budget "
                         f"{stream['batch_tokens']:,} tokens, planned reads {stream['read_bytes'] / 1e9:.2f} GB/pass"])
        if args.resident and not args.no_stream:
            import numpy as np

            resident = {"dtype": dtype, **({"max_length": args.max_length} if args.max_length else {})}
            wall, peak, info = _predict(args.model, resident, args.requests, Path(tmp) / "resident.npz")
            a, b = np.load(Path(tmp) / "stream.npz"), np.load(Path(tmp) / "resident.npz")
            delta = max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files)
            passes = len(info["batch_s"])
            rows.append(["resident", peak, info["loader"]["need_bytes"], None, passes, sum(info["batch_s"]) / passes,
                         None, None, f"max |Δp| streamed vs resident {delta:.2e}"])
        cli = [sys.executable, "-m", "clef_local.cli"]
        if args.drift:
            if args.candidate is None:
                parser.error("--drift needs --candidate")
            report = Path(tmp) / "drift.json"
            wall, peak, _ = _run([*cli, "drift", "--reference", str(args.model), "--candidate", str(args.candidate),
                                  "--limit", str(args.requests), "--max-memory", args.max_memory, "--dtype",
                                  args.dtype, "--json", str(report), "--no-progress",
                                  *(["--max-length", str(args.max_length)] if args.max_length else [])])
            summary = json.loads(report.read_text())["drift"][0]["summary"]
            rows.append(["drift", peak, None, None, None, None, None, None,
                         f"{wall:.0f} s wall; kl_mean {summary['kl_mean']:.3g}, flips {summary['flips']}"])
        if args.quantize:
            wall, peak, logged = _run([*cli, "quantize", "--model", str(args.model), "--bits", "4", "--out",
                                  str(args.quantize), "--max-memory", args.max_memory, "--force",
                                  *(["--validation-requests", str(args.validation_requests)]
                                    if args.validation_requests else []),
                                  *(["--int4-grid", args.int4_grid] if args.int4_grid else []),
                                  *(["--max-length", str(args.max_length)] if args.max_length else [])])
            if not (args.quantize / "validation.json").is_file():  # failed: nothing written; its log says how it ran
                verdict = " ".join(m.group(0) for m in re.finditer(r"validation [✓✗] +\S+ +\S+", logged))
                rows.append(["quantize + validation", peak, None, None, None, None, None, None,
                             f"{wall:.0f} s wall; validation FAILED (the variant was not written): {verdict}"])
                for m in re.finditer(r"(\w+) streamed from disk: ([0-9.]+) GB read in (\d+) pass(?:es)?, ([0-9.]+) s "
                                     r"per pass \(([0-9.]+) s reading\)", logged):
                    rows.append([f"validation: {m[1]}", None, None, float(m[2]) * 1e9, int(m[3]), float(m[4]),
                                 float(m[5]), None, "streamed"])
            else:
                validation = json.loads((args.quantize / "validation.json").read_text())
                rows.append(["quantize + validation", peak, None, None, None, None, None, None,
                             f"{wall:.0f} s wall; validation {'passed' if validation.get('passed') else 'FAILED'} "
                             f"in {validation.get('seconds', 0):.0f} s on {validation['requests']} probe requests, "
                             f"mean_kl {validation['metrics']['mean_kl']:.3g}, flips {validation['flips']}"])
                for role, run in validation.get("runs", {}).items():
                    streamed = run.get("streamed")
                    batches = max(run["batches"], 1)
                    rows.append([f"validation: {role}", None, None, streamed and streamed["bytes_read"], run["batches"],
                                 run["seconds"] / batches, streamed and streamed["read_seconds"],
                                 streamed and streamed["wait_seconds"],
                                 f"{'streamed' if streamed else 'resident'}, load {run['load_seconds']:.0f} s"])
    print(f"{args.model} under --max-memory {args.max_memory}, {args.requests} probe requests, dtype {args.dtype}, "
          f"max_length {args.max_length or 'default'}\n")
    print("| run | peak RSS (GiB) | planned peak (GiB) | bytes read (GB) | passes | s / pass | read s | wait s "
          "| notes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, peak, planned, read, passes, per_pass, read_s, wait_s, notes in rows:
        print(f"| {name} | {_gib(peak)} | {_gib(planned)} | {'—' if read is None else f'{read / 1e9:.2f}'} | "
              f"{'—' if passes is None else passes} | {'—' if per_pass is None else f'{per_pass:.1f}'} | "
              f"{'—' if read_s is None else f'{read_s:.1f}'} | {'—' if wait_s is None else f'{wait_s:.1f}'} | "
              f"{notes} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
