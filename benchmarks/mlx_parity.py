"""MLX backend vs torch backend on the same release and variants: parity and 3-question latency, one table.

    python benchmarks/mlx_parity.py                        # demo model: bf16 reference, int4, int8 (exported)
    python benchmarks/mlx_parity.py --variants int4=DIR4 int8=DIR8 --probes 4   # existing variants of --model
    python benchmarks/mlx_parity.py --tiny                 # tiny llama and qwen3_5 releases and their int4/int8

Both backends compute in float32 on the CPU and each runs in its own worker process: torch as installed, MLX with
Debian's OpenBLAS preloaded (docs/hardware.md, known traps: the Linux ``mlx-cpu`` wheel's reference BLAS is ~6× slower
for fp32 matmuls; ``--no-openblas`` turns that off). Per release: max |Δp| over all questions of the probe set
(``clef_local.data.probes.probe_requests``), decision flips (argmax changes), mean KL(torch‖mlx), and the median latency
of ``repeats`` decides of a 3-question request after one warm-up, as ms and as the MLX/torch ratio.
Tables in docs/benchmarks.md#parity-with-the-reference and docs/benchmarks.md#backends.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
THREE = {"model": "clef-local", "state": "My card payment was declined twice at the supermarket today.",
         "questions": {"complaint": {"type": "noul", "instructions": "Is the customer complaining?"},
                       "topic": {"type": "choice", "criteria": {"cards": None, "transfers": None, "account": None}},
                       "urgency": {"type": "score", "criteria": ["low", "medium", "high"]}}}


def worker(path: str, backend: str, requests_file: str, repeats: int, torch_kernel: str) -> None:
    """Load ``path`` on ``backend`` (float32, CPU), predict the probes, time THREE; print one JSON line."""
    import statistics
    import time

    import clef_local

    if backend == "torch" and torch_kernel == "kernel":
        import torch

        from clef_local.backends import quantized

        # force torch's int4/int8 CPU kernels even with float32 activations (by default float32 dequantizes: faster)
        quantized.KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

    requests = json.loads(Path(requests_file).read_text())
    model = clef_local.load(path, backend=backend, dtype="float32", device="cpu")
    probs = [[list(map(float, p)) for p in r.probabilities] for r in model.predict(requests, batch_size=4)]
    model.decide(THREE)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        response = model.decide(THREE)
        times.append(1e3 * (time.perf_counter() - started))
    print(json.dumps({"p": probs, "ms": statistics.median(times), "tokens": response["usage"]["input_tokens"],
                      "kernels": model.backend.describe().get("kernels")}))


def serve(path: str, backend: str) -> None:
    """Load ``path`` on ``backend`` (float32, CPU), decide THREE once (warm-up), then once per stdin line."""
    import time

    import clef_local

    model = clef_local.load(path, backend=backend, dtype="float32", device="cpu")
    print(json.dumps({"tokens": model.decide(THREE)["usage"]["input_tokens"]}), flush=True)
    for _ in sys.stdin:
        started = time.perf_counter()
        model.decide(THREE)
        print(json.dumps({"ms": 1e3 * (time.perf_counter() - started)}), flush=True)


def interleaved_latency(path: Path, rounds: int, openblas: bool) -> dict[str, float]:
    """Median 3-question latency per backend, the two workers alive together and timed in alternation (round by
    round), so a load change on a shared machine hits both alike."""
    import statistics

    procs = {}
    for backend in ("torch", "mlx"):
        env = dict(os.environ)
        if backend == "mlx" and openblas and OPENBLAS.is_file():
            env["LD_PRELOAD"] = str(OPENBLAS)
        procs[backend] = subprocess.Popen([sys.executable, __file__, "--serve", str(path), "--backend", backend],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        for proc in procs.values():
            json.loads(proc.stdout.readline())
        times: dict[str, list[float]] = {b: [] for b in procs}
        for _ in range(rounds):
            for backend, proc in procs.items():
                proc.stdin.write("go\n")
                proc.stdin.flush()
                times[backend].append(json.loads(proc.stdout.readline())["ms"])
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    return {b: statistics.median(t) for b, t in times.items()}


def run_worker(path: Path, backend: str, requests_file: Path, repeats: int, openblas: bool,
               torch_kernel: str) -> dict[str, Any]:
    env = dict(os.environ)
    if backend == "mlx" and openblas and OPENBLAS.is_file():
        env["LD_PRELOAD"] = str(OPENBLAS)
    cmd = [sys.executable, __file__, "--worker", str(path), "--backend", backend, "--requests", str(requests_file),
           "--repeats", str(repeats), "--torch-kernel", torch_kernel]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{backend} worker on {path} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def compare(ref: list[list[list[float]]], var: list[list[list[float]]]) -> dict[str, float]:
    from clef_local.export.validate import compare as validate_compare

    as_arrays = [[[np.asarray(p, np.float64) for p in r] for r in side] for side in (ref, var)]
    return validate_compare(*as_arrays)


def targets(args: argparse.Namespace, scratch: Path) -> list[tuple[str, str, Path]]:
    """(release label, variant label, path) for every release to measure."""
    from clef_local.export.quantize import quantize_release

    out: list[tuple[str, str, Path]] = []
    if args.tiny:
        from clef_local.testing import build_tiny_release

        sources = [("tiny llama", build_tiny_release(scratch / "llama", backbone="llama", seed=1)),
                   ("tiny qwen3_5", build_tiny_release(scratch / "qwen3_5", backbone="qwen3_5", seed=0))]
    else:
        from clef_local.demo.default import default_model_path

        sources = [("demo 135m" if args.model is None else args.model.name, args.model or default_model_path())]
    given = dict(v.split("=", 1) for v in args.variants)
    for label, source in sources:
        out.append((label, "bf16 reference", source))
        for scheme in args.schemes:
            path = Path(given[scheme]) if scheme in given else scratch / f"{label.replace(' ', '-')}-{scheme}"
            if not path.exists():
                quantize_release(source, path, scheme, validate=False, log_summary=False)
            out.append((label, scheme, path))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a BF16 release (default: the demo model)")
    parser.add_argument("--tiny", action="store_true", help="tiny llama and qwen3_5 releases instead")
    parser.add_argument("--schemes", nargs="*", default=["int4", "int8"], help="variants to export and compare")
    parser.add_argument("--variants", nargs="*", default=[], help="SCHEME=DIR of existing variants of --model")
    parser.add_argument("--probes", type=int, default=4, help="probe requests (clef_local.data.probes.probe_requests)")
    parser.add_argument("--repeats", type=int, default=3, help="timed decides of the 3-question request")
    parser.add_argument("--no-openblas", action="store_true", help="run MLX on its own reference BLAS")
    parser.add_argument("--torch-kernel", choices=["auto", "kernel"], default="auto",
                        help="torch's quantized layers in float32: the backend's choice (auto: dequantize-then-matmul) "
                             "or torch's int4/int8 CPU kernels (kernel; the fp32 int8 kernel took 126 s for one "
                             "339-token demo request here)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved torch/MLX rounds of the 3-question request on the reference")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--requests", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.backend)
        return 0
    if args.worker:
        worker(args.worker, args.backend, args.requests, args.repeats, args.torch_kernel)
        return 0

    from clef_local.data.probes import probe_requests

    rows = []
    latency: list[tuple[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="mlx-parity-") as tmp:
        scratch = Path(tmp)
        requests_file = scratch / "requests.json"
        requests_file.write_text(json.dumps(probe_requests(args.probes, seed=0)))
        for release, variant, path in targets(args, scratch):
            torch_run = run_worker(path, "torch", requests_file, args.repeats, False, args.torch_kernel)
            mlx_run = run_worker(path, "mlx", requests_file, args.repeats, not args.no_openblas, args.torch_kernel)
            metrics = compare(torch_run["p"], mlx_run["p"])
            rows.append((release, variant, metrics["questions"], metrics["max_abs_dp"], metrics["flips"],
                         metrics["mean_kl"], mlx_run["tokens"], torch_run["ms"], mlx_run["ms"],
                         mlx_run["ms"] / torch_run["ms"]))
            if variant == "bf16 reference" and args.rounds:
                latency.append((release, interleaved_latency(path, args.rounds, not args.no_openblas)))
            print(f"done: {release} {variant} (torch {torch_run['kernels']}, mlx {mlx_run['kernels']})",
                  file=sys.stderr, flush=True)
    blas = "reference BLAS" if args.no_openblas else "OpenBLAS preloaded"
    print(f"MLX (float32, CPU, {blas}) vs torch (float32, CPU, quantized kernels: {args.torch_kernel}); "
          f"{args.probes} probe requests; 3-question request: median of {args.repeats} after a warm-up")
    print("| release | variant | questions | max \\|Δp\\| | flips | mean KL | 3-q tokens | torch ms | MLX ms "
          "| MLX/torch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.2e} | {r[4]} | {r[5]:.1e} | {r[6]} | {r[7]:.0f} | {r[8]:.0f} | "
              f"{r[9]:.2f} |")
    if latency:
        print(f"\n3-question request on the reference, float32 CPU, median of {args.rounds} interleaved rounds")
        print("| release | torch ms | MLX ms | MLX/torch |")
        print("|---|---|---|---|")
        for release, ms in latency:
            print(f"| {release} | {ms['torch']:.0f} | {ms['mlx']:.0f} | {ms['mlx'] / ms['torch']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
