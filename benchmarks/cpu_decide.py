"""One ``clef-local decide`` of an N-token request on a CPU, per code tree: time, peak RSS, and the forward's share
of the CPU's BF16 peak.

    # reduced size (4 of Clef-flash's 32 layers), built here, the tree before the change against this one:
    git archive BASE | tar -x -C /tmp/before
    python benchmarks/cpu_decide.py --build /tmp/flash-int4 --layers 4 --vocab-size 4096 --tokens 615 \\
        --code before=/tmp/before --code after=.
    # full size: a variant made beforehand (quantize --no-validate of benchmarks/synthetic_release.py's BF16 release)
    python benchmarks/cpu_decide.py --model /data/clef-flash-int4 --tokens 615 --code before=/tmp/before --code after=.

Each tree runs ``clef-local decide --model DIR --request FILE`` in a fresh process, one run each (interleave them
yourself for repeats): the console script's own path (``clef_local.cli.main()`` with no arguments, so the CLI's
thread rule applies as it would for a user), with ``clef_local.load`` wrapped to time the load, ``PYTHONPATH`` the
tree. ``OMP_NUM_THREADS`` and ``CLEF_LOCAL_THREADS`` are removed from the environment unless ``--keep-env``. The
request is the triage example with its state cut to give exactly ``--tokens`` tokens (with the release's
tokenizer). Peak RSS is the child's ``ru_maxrss`` (``os.wait4``). The forward's GFLOP/s is 2 · tokens · the decoder
layers' linear weights (from the safetensors headers; attention and the gated delta net's recurrence are left out,
so the share is a lower bound) over the decide's time after loading; the BF16 peak is a dense bf16 matmul
[tokens, hidden] @ [hidden, intermediate] on every physical core in a process of its own. Table in
docs/benchmarks.md#int4-and-int8-on-a-cpu.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import run_child

from clef_local.decide import read_request
from clef_local.formats.release import find_weight_files, read_json
from clef_local.formats.safetensors import read_header
from clef_local.runtime.encoding import encode_request
from clef_local.runtime.schema import validate_request
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.units import GiB

RUNNER = """
import json, sys, time
started = time.perf_counter()
import clef_local, clef_local.cli
seen = {}
load = clef_local.load
def timed_load(*args, **kwargs):
    begin = time.perf_counter()
    model = load(*args, **kwargs)
    seen["load_s"] = time.perf_counter() - begin
    seen["kernels"] = model.describe().get("kernels", {})
    seen["loaded_at"] = time.perf_counter()
    return model
clef_local.load = timed_load
sys.argv = ["clef-local", "decide", "--model", sys.argv[1], "--request", sys.argv[2]]
code = clef_local.cli.main()
import torch
seen.update(code=code, total_s=time.perf_counter() - started, decide_s=time.perf_counter() - seen["loaded_at"],
            threads=torch.get_num_threads())
print("CLEF_DECIDE " + json.dumps(seen), file=sys.stderr)
"""

PEAK = """
import json, sys, time, torch
from clef_local.planning.hardware import physical_cores
torch.set_num_threads(physical_cores())
m, k, n = (int(v) for v in sys.argv[1:4])
a, b = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16()
best = float("inf")
for _ in range(5):
    begin = time.perf_counter()
    a @ b
    best = min(best, time.perf_counter() - begin)
print(json.dumps({"gflops": 2 * m * k * n / best / 1e9, "threads": torch.get_num_threads()}))
"""


def sized_request(model: Path, tokens: int) -> tuple[dict, int]:
    """The triage example with its state cut to the longest prefix that encodes to at most ``tokens`` tokens."""
    tokenizer = ReleaseTokenizer(model)
    base = read_request(None, "triage")
    text = " ".join([base["state"]] * (4 * tokens // max(1, len(base["state"].split())) + 8))

    def count(chars: int) -> int:
        request = validate_request({**base, "state": text[:chars]})
        return len(encode_request(tokenizer, request, max_length=1 << 20).input_ids)

    low, high = 1, len(text)
    if count(high) < tokens:
        raise SystemExit(f"--tokens {tokens}: the longest state here gives {count(high)} tokens")
    while low < high:  # the longest prefix with count <= tokens
        mid = (low + high + 1) // 2
        low, high = (mid, high) if count(mid) <= tokens else (low, mid - 1)
    return {**base, "state": text[:low]}, count(low)


def linear_weights(model: Path) -> tuple[int, int, int]:
    """(weights in the decoder layers' linear layers, hidden size, intermediate size) from the headers."""
    total = 0
    for file in find_weight_files(model):
        for name, info in read_header(file).tensors.items():
            shape = info.shape
            if ".layers." not in name or not name.endswith(".weight") or len(shape) != 2 or "norm" in name:
                continue
            total += shape[0] * shape[1] * (8 if info.dtype == "U32" else 1)  # int4: 8 codes per uint32 word
    text = read_json(model / "config.json")
    text = text.get("text_config", text)
    return total, int(text["hidden_size"]), int(text["intermediate_size"])


def run_tree(tree: Path, model: Path, request: Path, keep_env: bool) -> dict:
    """One decide in a fresh process with ``tree`` on PYTHONPATH: the runner's numbers, wall time, peak RSS."""
    env = dict(os.environ) if keep_env else {k: v for k, v in os.environ.items()
                                              if k not in ("OMP_NUM_THREADS", "CLEF_LOCAL_THREADS")}
    env["PYTHONPATH"] = str(tree.resolve())
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        run = run_child([sys.executable, "-c", RUNNER, str(model), str(request)], stdout=out, stderr=err, env=env,
                        cwd=tree)
        err.seek(0)
        log = err.read().decode(errors="replace")
    lines = [line for line in log.splitlines() if line.startswith("CLEF_DECIDE ")]
    if run.code != 0 or not lines:
        raise SystemExit(f"{tree}: decide failed (exit {run.code}):\n{log[-3000:]}")
    return json.loads(lines[-1].removeprefix("CLEF_DECIDE ")) | {"wall_s": run.wall_s, "peak_rss": run.peak_rss}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", type=Path, help="an existing release or variant")
    where.add_argument("--build", type=Path, help="build a Clef-flash-shaped int4 variant here (kept if present)")
    parser.add_argument("--layers", type=int, default=4, help="--build: decoder layers (default 4 of 32)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="--build: vocabulary (default 4096)")
    parser.add_argument("--tokens", type=int, default=615)
    parser.add_argument("--code", action="append", default=[], metavar="NAME=TREE",
                        help="a source tree to run (repeatable; default: after=. )")
    parser.add_argument("--keep-env", action="store_true", help="keep OMP_NUM_THREADS / CLEF_LOCAL_THREADS")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args(argv)
    model = args.model
    if args.build is not None:
        model = args.build
        if not (model / "config.json").is_file():
            from clef_local.planning.planner import resolve_config
            from clef_local.testing import build_shaped_release

            build_shaped_release(resolve_config("clef-flash"), model, scheme="int4", layers=args.layers,
                                 vocab_size=args.vocab_size)
    trees = dict(item.split("=", 1) for item in (args.code or ["after=."]))
    request, tokens = sized_request(model, args.tokens)
    weights, hidden, intermediate = linear_weights(model)
    flops = 2 * tokens * weights
    peak = json.loads(subprocess.run([sys.executable, "-c", PEAK, str(tokens), str(hidden), str(intermediate)],
                                     capture_output=True, text=True, check=True).stdout)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        request_file = Path(tmp) / "request.json"
        request_file.write_text(json.dumps(request))
        for name, tree in trees.items():
            rows[name] = run_tree(Path(tree), model, request_file, args.keep_env)
            print(f"  {name}: {json.dumps(rows[name])}", file=sys.stderr, flush=True)
    print(f"{model}: {tokens}-token request, {weights / 1e9:.2f} G linear weights in the decoder layers "
          f"({flops / 1e12:.2f} TFLOP per pass); BF16 peak {peak['gflops']:.0f} GFLOP/s "
          f"({peak['threads']} threads, [{tokens}, {hidden}] @ [{hidden}, {intermediate}])")
    print()
    print("| code | threads | kernels | decide command s | load s | decide after load s | peak RSS GiB | "
          "GFLOP/s after load | share of BF16 peak |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        rate = flops / row["decide_s"] / 1e9
        kernels = ", ".join(f"{k} × {v}" for k, v in row["kernels"].items()) or "dense"
        print(f"| {name} | {row['threads']} | {kernels} | {row['wall_s']:.1f} | {row['load_s']:.1f} | "
              f"{row['decide_s']:.1f} | {row['peak_rss'] / GiB:.2f} | {rate:.0f} | {rate / peak['gflops']:.0%} |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "tokens": tokens, "flops": flops, "peak": peak,
                                         "runs": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
