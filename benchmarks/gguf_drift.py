"""Drift of the demo model's GGUF types on llama.cpp, with and without the decision importance matrix, beside
clef-local's own int8, int4 g32 and nf4 on torch: one ``clef-local drift`` report, every figure with its 95% interval.

    python benchmarks/gguf_drift.py --out /tmp/gguf-drift                               # 40 + 12 requests
    python benchmarks/gguf_drift.py --out /tmp/gguf-drift --types Q8_0 Q4_K_M --b77-rows 100

Each GGUF is written by ``clef-local export-gguf --no-validate`` (llama.cpp's quantizer; ``+imatrix``: with
``--imatrix``) into ``--variants`` when missing, each clef-local variant by ``clef-local quantize --no-validate``
(benchmarks/drift_demo.py). Every model computes in float32 (the GGUFs: F32 KV cache). Data: BANKING77 test rows and
NLU++ banking folds 16-19 as labelled JSONL (as drift_demo.py). The table: each candidate's tensor types (read back from
its file) and size, then drift's own table: mean KL and flip rate with their intervals. Table in
docs/benchmarks.md#gguf-on-llamacpp.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from drift_demo import ensure_variants

from clef_local.data.convert import load_dataset, parse_folds
from clef_local.data.jsonl import write_jsonl
from clef_local.demo.default import default_model_path

TYPES = ("Q8_0", "Q6_K", "Q4_K_M", "IQ4_XS")
SCHEMES = ("int8", "int4-g32", "nf4")


def ensure_ggufs(reference: Path, directory: Path, types: list[str]) -> list[Path]:
    """``directory/demo-gguf-<type>[-imatrix]`` for each type, with and without ``--imatrix``, made when missing."""
    from clef_local.export.gguf.export import export_gguf

    paths = []
    for qtype in types:
        for imatrix in (False, True):
            out = directory / f"demo-gguf-{qtype}{'-imatrix' if imatrix else ''}"
            if not out.is_dir():
                started = time.perf_counter()
                export_gguf(reference, out, qtype, validate=False, imatrix=imatrix)
                print(f"export-gguf {qtype}{' --imatrix' if imatrix else ''}: {time.perf_counter() - started:.0f} s",
                      flush=True)
            paths.append(out)
    return paths


def describe(candidate: Path) -> tuple[str, int]:
    """The tensor types a candidate's backbone holds and its bytes on disk."""
    config = candidate / "gguf" / "gguf_config.json"
    size = sum(f.stat().st_size for f in candidate.rglob("*") if f.is_file() and f.suffix in (".gguf", ".safetensors")
               and not f.name.startswith("joint_head"))
    if config.is_file():
        types = json.loads(config.read_text())["tensor_types"]
        return ", ".join(f"{k} {v}" for k, v in sorted(types.items(), key=lambda kv: -kv[1])), size
    quant = json.loads((candidate / "config.json").read_text()).get("quantization_config", {})
    return f"{quant.get('quant_method', '?')} {quant.get('clef_local', {}).get('scheme', '')}".strip(), size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", type=Path, default=Path.home() / ".cache" / "clef-local" / "variants")
    parser.add_argument("--types", nargs="+", default=list(TYPES))
    parser.add_argument("--schemes", nargs="*", default=list(SCHEMES))
    parser.add_argument("--b77-rows", type=int, default=40)
    parser.add_argument("--nlupp-rows", type=int, default=12)
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    reference = default_model_path()
    ggufs = ensure_ggufs(reference, args.variants, args.types)
    ours = ensure_variants(reference, args.variants, args.schemes)
    args.out.mkdir(parents=True, exist_ok=True)
    examples = load_dataset("banking77", split="test", limit=args.b77_rows)
    examples += load_dataset("nlupp", folds=parse_folds("16-19"), limit=args.nlupp_rows)
    data = args.out / "drift_data.jsonl"
    write_jsonl(examples, data)
    questions = sum(len(e.request["questions"]) for e in examples)
    print(f"data: BANKING77 test rows 0-{args.b77_rows - 1}, NLU++ folds 16-19 first {args.nlupp_rows}: "
          f"{len(examples)} requests, {questions} questions", flush=True)
    from clef_local.quality.drift_cli import main as drift_main

    candidates = [*ggufs, *ours]
    started = time.perf_counter()
    code = drift_main(["--reference", str(reference), *[a for c in candidates for a in ("--candidate", str(c))],
                       "--data", str(data), "--dtype", "float32", "--resamples", str(args.resamples),
                       "--json", str(args.out / "report.json"), "--md", str(args.out / "report.md")])
    print(f"drift took {time.perf_counter() - started:.0f} s (exit {code})\n")
    print((args.out / "report.md").read_text())
    print("| candidate | backend | tensor types | MB |")
    print("|---|---|---|---:|")
    for candidate in candidates:
        types, size = describe(candidate)
        backend = "llamacpp" if (candidate / "gguf").is_dir() else "torch"
        print(f"| {candidate.name} | {backend} | {types} | {size / 1e6:.0f} |")
    return code


if __name__ == "__main__":
    sys.exit(main())
