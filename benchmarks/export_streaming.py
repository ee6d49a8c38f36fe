"""Streaming export: peak memory of ``clef-local quantize`` is bounded by a shard, not by the model (docs/format.md §6).

    python benchmarks/export_streaming.py            # ~165 MB BF16 llama in 8+ shards and in 1 shard, int4
    python benchmarks/export_streaming.py --scheme nf4 --layers 8

Builds a llama backbone (hidden 512, intermediate 2048, ``--layers`` layers, the tiny release's tokenizer and a
matching random head) saved once in ``--shards`` files and once in one file, exports each in a fresh subprocess
that imports everything and warms up first, and reads the subprocess's peak RSS (``VmHWM``) minus its RSS after
the warm-up. Exit status 1 unless the sharded export's peak is bounded by its shards, not the model: at most
``--shards-limit`` (4) times its largest shard and at most half the one-shard export's peak.
Numbers in docs/benchmarks.md#export-size-and-memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = r"""
import json, sys, time
from pathlib import Path
import torch, safetensors.torch, tqdm
from clef_local.export.quantize import quantize_release
from clef_local import quant

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

source, out, scheme = sys.argv[1:4]
quant.get(scheme).quantize(torch.randn(64, 128, dtype=torch.bfloat16), None)  # warm up kernels and threads
baseline = status("VmRSS")
started = time.perf_counter()
summary = quantize_release(Path(source), Path(out), scheme, validate=False, log_summary=False)
print(json.dumps({"baseline": baseline, "peak": status("VmHWM"), "seconds": time.perf_counter() - started,
                  "linear_ratio": summary["bytes"]["linear_after"] / summary["bytes"]["linear_before"]}))
"""


def build_sources(root: Path, layers: int, shard_counts: tuple[int, ...]) -> dict[int, Path]:
    """One random ~(6.8 MB × layers) BF16 llama backbone saved as a release in each of ``shard_counts`` files
    (``save_pretrained`` may open one more shard than asked)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from clef_local.heads.torch_head import JointSchemaHead
    from clef_local.testing import DEFAULT_HEAD, build_tiny_release

    hf_logging.disable_progress_bar()
    paths = {}
    model = None
    for shards in shard_counts:
        path = build_tiny_release(root / f"src-{shards}", "llama", seed=0)
        if model is None:
            config = AutoConfig.from_pretrained(path)
            config.update({"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": layers,
                           "num_attention_heads": 8, "num_key_value_heads": 4})
            torch.manual_seed(0)
            model = LlamaForCausalLM(config).to(torch.bfloat16)
            total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        (path / "model.safetensors").unlink()
        model.save_pretrained(path, max_shard_size=total // shards + 1 if shards > 1 else "100GB")
        head_config = dataclasses.replace(DEFAULT_HEAD, hidden_size=512)
        head = JointSchemaHead(head_config)
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, path / "joint_head.safetensors")
        keys = ("hidden_size", "width", "routing_layers", "layers", "heads", "feedforward")
        (path / "joint_head_config.json").write_text(json.dumps({k: getattr(head_config, k) for k in keys}))
        paths[shards] = path
    return paths


def measure(source: Path, out: Path, scheme: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(source), str(out), scheme], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--scheme", default="int4")
    parser.add_argument("--shards-limit", type=float, default=4.0,
                        help="max peak RSS increase of the sharded export / its largest shard")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shards, source in build_sources(Path(tmp), args.layers, (args.shards, 1)).items():
            files = sorted(source.glob("model*.safetensors"))
            size = sum(f.stat().st_size for f in files)
            result = measure(source, Path(tmp) / f"out-{shards}", args.scheme)
            rows.append({"shards": len(files), "model": size, "largest": max(f.stat().st_size for f in files),
                         **result, "delta": result["peak"] - result["baseline"]})
    table = Table(title=f"{args.scheme} export, peak RSS above the post-import baseline (subprocess)")
    for column in ("shards", "model MB", "largest shard MB", "baseline MB", "peak MB", "Δ MB", "Δ / model",
                   "linear after/before", "export s"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["shards"]), f"{r['model'] / 1e6:.1f}", f"{r['largest'] / 1e6:.1f}",
                      f"{r['baseline'] / 1e6:.0f}", f"{r['peak'] / 1e6:.0f}", f"{r['delta'] / 1e6:.1f}",
                      f"{r['delta'] / r['model']:.1%}", f"{r['linear_ratio']:.3f}", f"{r['seconds']:.1f}")
    Console().print(table)
    sharded, whole = rows
    per_shard = sharded["delta"] / sharded["largest"]
    ok = sharded["shards"] >= 8 and per_shard <= args.shards_limit and sharded["delta"] <= whole["delta"] / 2
    print(f"{'ok' if ok else 'FAIL'}: {sharded['shards']} shards, peak +{sharded['delta'] / 1e6:.1f} MB = "
          f"{per_shard:.1f} × the largest shard (limit {args.shards_limit:g}) and "
          f"{sharded['delta'] / whole['delta']:.0%} of the one-shard export's (limit 50%); "
          f"total {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
