"""int4's grids on one Clef-flash MLP weight, before / after a change: seconds, MB/s of the source weight, same bytes.

    python benchmarks/grid_speed.py                     # 12288 x 4096 bf16, groups 64 and 32, against --before
    python benchmarks/grid_speed.py --rows 1024 --repeats 1 --groups 64
    python benchmarks/grid_speed.py --before 3e3a44d    # any revision whose int4.py has the same two functions

The weight is seeded Gaussian (× 0.02) in bf16. Each grid runs through ``quantize_values`` (MLX layout: ``mlx``,
``mse``) and ``zero_point_values`` (``compressed mlx``, ``compressed mse``) of this checkout ("after") and of
``clef_local/quant/int4.py`` at ``--before`` ("before", read with ``git show`` and imported from a temporary file;
it needs nothing but torch). Default ``--before``: the parent of the commit that put int4's grids in CPU blocks.
One warm-up call (its outputs are the ones compared, bit for bit), then the median of ``--repeats`` calls. Threads:
every physical core (the one-shot rule, clef_local.planning.hardware.thread_plan) unless ``--threads``.
Table in docs/benchmarks.md#int4-grid-speed.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from _timing import median_ms

from clef_local.planning.hardware import thread_plan
from clef_local.quant import int4

ROOT = Path(__file__).resolve().parents[1]
MODULE = "clef_local/quant/int4.py"
GRIDS = (("mlx", "quantize_values", "mlx"), ("mse", "quantize_values", "mse"),
         ("compressed mlx", "zero_point_values", "mlx"), ("compressed mse", "zero_point_values", "mse"))
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def default_before() -> str:
    """The parent of the first commit whose int4.py has ``_by_blocks`` (the blocked grids)."""
    commits = git("log", "--reverse", "--format=%h", "-S", "_by_blocks", "--", MODULE).split()
    if not commits:
        raise SystemExit(f"no commit adds _by_blocks to {MODULE}: pass --before REV")
    return f"{commits[0]}^"


def load_before(rev: str, directory: Path) -> ModuleType:
    """``clef_local/quant/int4.py`` as of ``rev``, imported as a module of its own."""
    path = directory / "int4_before.py"
    path.write_text(git("show", f"{rev}:{MODULE}"), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("int4_before", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def same_bytes(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    """Every output of the same dtype, shape and bits (-0.0 is not 0.0 here)."""
    return all(x.dtype == y.dtype and x.shape == y.shape
               and torch.equal(x.view(BITS.get(x.dtype, x.dtype)), y.view(BITS.get(y.dtype, y.dtype)))
               for x, y in zip(a, b, strict=True))


def timed(fn: Callable[..., tuple[torch.Tensor, ...]], weight: torch.Tensor, group: int, grid: str, repeats: int
          ) -> tuple[float, tuple[torch.Tensor, ...]]:
    """(median seconds, outputs) of ``fn(weight, group, grid)``."""
    outputs: list[tuple[torch.Tensor, ...]] = []
    seconds = median_ms(lambda: outputs.append(fn(weight, group, grid)), repeats) / 1e3
    return seconds, outputs[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=12288, help="output features (default: Clef-flash's MLP)")
    parser.add_argument("--cols", type=int, default=4096, help="input features")
    parser.add_argument("--groups", default="64,32", help="int4 group sizes, comma-separated")
    parser.add_argument("--before", help="the revision to compare with (default: before the blocked grids)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per cell after one warm-up")
    parser.add_argument("--threads", type=int, help="intra-op threads (default: every physical core)")
    args = parser.parse_args(argv)
    torch.set_num_threads(thread_plan(threads=args.threads, role="command").intra_op)
    weight = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0)).mul_(0.02)
    weight = weight.to(torch.bfloat16)
    megabytes = weight.numel() * weight.element_size() / 1e6
    before_rev = args.before or default_before()
    with tempfile.TemporaryDirectory() as tmp:
        before = load_before(before_rev, Path(tmp))
    label = git("rev-parse", "--short", before_rev).strip()
    print(f"weight {args.rows} x {args.cols} bf16 ({megabytes:.0f} MB), {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, before = {before_rev} ({label}), median of {args.repeats}", flush=True)
    rows, equal = [], True
    for group in (int(g) for g in args.groups.split(",")):
        for name, function, grid in GRIDS:
            seconds, outputs = {}, {}
            for side, module in (("before", before), ("after", int4)):
                seconds[side], outputs[side] = timed(getattr(module, function), weight, group, grid, args.repeats)
            same = same_bytes(outputs["before"], outputs["after"])
            equal &= same
            rows.append((name, group, seconds, same))
            print(f"  {name} g{group}: before {seconds['before']:.2f} s, after {seconds['after']:.2f} s, "
                  f"{'same bytes' if same else 'BYTES DIFFER'}", file=sys.stderr, flush=True)
    print()
    print("| grid | group | before s | after s | before MB/s | after MB/s | before / after | same bytes |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, group, s, same in rows:
        print(f"| {name} | {group} | {s['before']:.2f} | {s['after']:.2f} | {megabytes / s['before']:.0f} | "
              f"{megabytes / s['after']:.0f} | {s['before'] / s['after']:.1f}× | {'✓' if same else '✗'} |")
    if not equal:
        print("\nthe bytes differ: the change is not a pure speed-up", file=sys.stderr)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
