"""Build a full-size synthetic release (random weights, the exact shapes) and check it against the planner.

    python benchmarks/synthetic_release.py --config clef-flash --scheme int4 --out /tmp/clef-flash-int4 --delete
    python benchmarks/synthetic_release.py --config clef --scheme int4 --out /data/clef-int4      # Clef 27B
    python benchmarks/synthetic_release.py --config clef --scheme int4 --layers 4 --vocab-size 1024 --out DIR

A CLI over :func:`clef_local.testing.build_shaped_release`. Prints one table: the time and rate of the build, the
process's peak RSS (``getrusage``: everything this Python process ever held, torch and transformers included), and
the weight bytes three ways, per role: the files' tensor bytes (each file's size less its 8-byte length and JSON
header), ``clef-local plan --model OUT`` (the census from the headers) and ``clef-local plan --config`` on the same
(reduced) config (the planner's formulas over the architecture built on the meta device). ``--json`` writes the
numbers; ``--delete`` removes the release afterwards (they are large). Exit 1 when the three disagree.
Table in docs/benchmarks.md#flagship-desks-full-size-shapes-two-cards-caps.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import struct
import sys
import time
from pathlib import Path

from clef_local.formats.release import find_weight_files, read_json
from clef_local.planning.census import WeightCensus, census_from_config, census_from_release
from clef_local.planning.planner import resolve_config
from clef_local.synthetic import SCHEMES
from clef_local.testing import build_shaped_release
from clef_local.units import GiB

ROLES = ("quantized_linears", "text_other", "embed_tokens", "lm_head", "vision")


def tensor_bytes(file: Path) -> int:
    """A safetensors file's data section: its size less the 8-byte length and the JSON header."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    return file.stat().st_size - 8 - length


def peak_rss() -> int:
    """This process's peak resident set (bytes; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def compare(out: Path, scheme: str) -> dict[str, dict[str, int]]:
    """Weight bytes per role: from the headers (plan --model) and from the config (plan --config), and the files'
    data sections."""
    config = read_json(out / "config.json")
    files = find_weight_files(out)
    stored = census_from_release(out, files, config)
    formula: WeightCensus = census_from_config(out / "config.json", scheme, head_config_path=out /
                                               "joint_head_config.json")
    rows = {role: {"headers": getattr(stored, role), "config": getattr(formula, role)} for role in ROLES}
    rows["backbone"] = {"headers": stored.backbone, "config": formula.backbone,
                        "files": sum(tensor_bytes(f) for f in files)}
    rows["head (float32)"] = {"headers": stored.head_stored, "config": formula.head,
                              "files": tensor_bytes(out / "joint_head.safetensors")}
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="clef-flash", help="clef, clef-flash or a config.json path")
    parser.add_argument("--scheme", default="int4", choices=SCHEMES)
    parser.add_argument("--out", type=Path, required=True, help="directory to create (must not exist or be empty)")
    parser.add_argument("--layers", type=int, help="only the first N decoder layers")
    parser.add_argument("--vocab-size", type=int, help="a smaller vocabulary")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, help="generating threads (default: the usable cores)")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--delete", action="store_true", help="remove the release after the checks")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args(argv)
    config = resolve_config(args.config)
    started = time.perf_counter()
    out = build_shaped_release(config, args.out, scheme=args.scheme, layers=args.layers, seed=args.seed,
                               vocab_size=args.vocab_size, group_size=args.group_size, workers=args.workers)
    seconds = time.perf_counter() - started
    rss = peak_rss()
    written = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    rows = compare(out, args.scheme)
    equal = all(len(set(r.values())) == 1 for r in rows.values())
    label = f"{config.name.removesuffix('.config.json')} {args.scheme}" + (
        f", {args.layers} layers" if args.layers else "") + (f", vocab {args.vocab_size}" if args.vocab_size else "")
    print(f"{label}: {written / GiB:.2f} GiB written in {seconds:.1f} s ({written / GiB / seconds:.2f} GiB/s), "
          f"peak RSS {rss / GiB:.2f} GiB\n")
    print("| weights (bytes) | files' tensor bytes | plan --model (headers) | plan --config (formulas) | equal |")
    print("|---|---:|---:|---:|---|")
    for role, row in rows.items():
        cells = [f"{row[k]:,}" if k in row else "" for k in ("files", "headers", "config")]
        print(f"| {role} | " + " | ".join(cells) + f" | {'yes' if len(set(row.values())) == 1 else 'NO'} |")
    if args.json:
        args.json.write_text(json.dumps({"label": label, "seconds": seconds, "written_bytes": written,
                                         "peak_rss_bytes": rss, "bytes": rows, "equal": equal}, indent=2) + "\n")
    if args.delete:
        shutil.rmtree(out)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
