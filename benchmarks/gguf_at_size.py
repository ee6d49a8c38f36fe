"""Clef-flash's shape as GGUF: ``export-gguf --type Q4_K_M`` of a full-size BF16 release (time, peak RSS, size), then
one N-token ``decide`` on llama.cpp against the int4 variant on torch — time, peak RSS, share of this CPU's BF16
peak — in one run.

    python benchmarks/synthetic_release.py --config clef-flash --scheme bf16 --out /data/flash-bf16
    python benchmarks/gguf_at_size.py --model /data/flash-bf16 --work /data/gguf-at-size

Each step runs as the console script in a fresh process (``os.wait4``: the child's own peak RSS): ``clef-local
export-gguf --model MODEL --type Q4_K_M --no-validate --out WORK/q4_k_m`` and ``clef-local quantize --model MODEL
--bits 4 --no-validate --out WORK/int4`` (each kept when already there: ``--fresh`` redoes them), then
``cpu_decide.py``'s decide of the triage request cut to ``--tokens`` tokens on each, ``--repeats`` times, alternating
(the first decide of each reads its weights from the page cache the export left, or from disk). ``auto`` runs the
GGUF release on llama.cpp (F16 KV cache, the default) and the int4 variant on torch. GFLOP/s counts the BF16
release's decoder linear weights (2 · tokens · weights, as cpu_decide.py: a lower bound) over the decide after
loading; the BF16 peak is cpu_decide.py's dense matmul, in the same run. Table in
docs/benchmarks.md#gguf-on-llamacpp.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _timing import run_child
from cpu_decide import PEAK, linear_weights, run_tree, sized_request

from clef_local.units import GiB


def run_step(command: list[str], log: Path) -> dict[str, Any]:
    """One console-script step in a fresh process: wall, the child's peak RSS, exit status (its stderr to ``log``)."""
    print("$", " ".join(command), file=sys.stderr, flush=True)
    with log.open("w") as sink:
        run = run_child(command, stderr=sink)
    if run.code != 0:
        raise SystemExit(f"{' '.join(command)} exited {run.code}:\n{log.read_text()[-3000:]}")
    return {"wall_s": run.wall_s, "peak_rss": run.peak_rss}


def size_of(directory: Path, suffixes: tuple[str, ...]) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file() and f.suffix in suffixes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a BF16 release (benchmarks/synthetic_release.py)")
    parser.add_argument("--work", type=Path, required=True, help="a folder for the GGUF and the int4 variant")
    parser.add_argument("--type", default="Q4_K_M", help="the GGUF type (default Q4_K_M)")
    parser.add_argument("--tokens", type=int, default=615)
    parser.add_argument("--repeats", type=int, default=2, help="decides per model, alternating")
    parser.add_argument("--fresh", action="store_true", help="redo the export and the quantize when present")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "clef_local.cli"]
    gguf, int4 = args.work / args.type.lower(), args.work / "int4"
    steps: dict[str, dict[str, Any]] = {}
    for name, out, flags in ((f"export-gguf --type {args.type}", gguf, ["export-gguf", "--type", args.type]),
                             ("quantize --bits 4", int4, ["quantize", "--bits", "4"])):
        if args.fresh and out.exists():
            shutil.rmtree(out)
        if not (out / "config.json").is_file():
            steps[name] = run_step([*cli, *flags, "--model", str(args.model), "--no-validate", "--out", str(out)],
                                   args.work / f"{out.name}.log")
            steps[name]["bytes"] = size_of(out, (".gguf", ".safetensors"))
            print(f"  {name}: {json.dumps(steps[name])}", file=sys.stderr, flush=True)

    weights, hidden, intermediate = linear_weights(args.model)
    request, tokens = sized_request(args.model, args.tokens)
    flops = 2 * tokens * weights
    peak = json.loads(subprocess.run([sys.executable, "-c", PEAK, str(tokens), str(hidden), str(intermediate)],
                                     capture_output=True, text=True, check=True).stdout)
    tree = Path(__file__).resolve().parent.parent
    runs: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        request_file = Path(tmp) / "request.json"
        request_file.write_text(json.dumps(request))
        for repeat in range(args.repeats):
            for label, model in ((f"{args.type} on llama.cpp", gguf), ("int4 g64 on torch", int4)):
                row = run_tree(tree, model, request_file, keep_env=False)
                runs.append((label, row))
                print(f"  {label} #{repeat + 1}: {json.dumps(row)}", file=sys.stderr, flush=True)

    print(f"{args.model}: {weights / 1e9:.2f} G linear weights in the decoder layers; {tokens}-token request "
          f"({flops / 1e12:.2f} TFLOP per pass); BF16 peak {peak['gflops']:.0f} GFLOP/s ({peak['threads']} threads)\n")
    if steps:
        print("| step | wall | peak RSS GiB | written GB |")
        print("|---|---:|---:|---:|")
        for name, step in steps.items():
            print(f"| `{name} --no-validate` | {step['wall_s'] / 60:.1f} min | {step['peak_rss'] / GiB:.2f} | "
                  f"{step['bytes'] / 1e9:.2f} |")
        print()
    print("| model | run | decide command s | load s | decide after load s | peak RSS GiB | GFLOP/s | "
          "share of BF16 peak |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    seen: dict[str, int] = {}
    for label, row in runs:
        seen[label] = seen.get(label, 0) + 1
        rate = flops / row["decide_s"] / 1e9
        print(f"| {label} | {seen[label]} | {row['wall_s']:.1f} | {row['load_s']:.1f} | {row['decide_s']:.1f} | "
              f"{row['peak_rss'] / GiB:.2f} | {rate:.0f} | {rate / peak['gflops']:.0%} |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "tokens": tokens, "flops": flops, "peak": peak,
                                         "steps": steps, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
