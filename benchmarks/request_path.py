"""The request path of a cold one-shot ``decide``, for one or more source trees in one run (before / after a change).

    python benchmarks/request_path.py                                 # this checkout
    python benchmarks/request_path.py --tree /tmp/before --tree .    # two trees, alternated, same machine, same run

For each tree, in fresh processes (``PYTHONPATH`` = the tree): on tiny llama and Qwen3.5 releases, with ``load``'s
defaults, the backbone forwards one cold ``decide`` runs and the clef_local frames between ``ClefModel.decide`` and the
text model's ``forward``; on the demo model (``load``'s defaults: BF16 where this CPU runs it faster), the load, the
first ``decide`` after it (README's triage example) and the 77-way BANKING77 request, cold and again. Each tree runs
``--repeats`` times, alternated; the table gives medians. Results: docs/benchmarks.md#request-path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = r'''
import inspect, json, sys, tempfile, time
from pathlib import Path

import clef_local
from clef_local.model import ClefModel

PACKAGE = str(Path(clef_local.__file__).parent)


def frames(model, request):
    """(forwards, clef_local frames of the deepest one) of model.decide(request)."""
    target = inspect.unwrap(type(model.backend.backbone.text_model).forward).__code__
    depths = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is target:
            depth, f = 0, frame.f_back
            while f is not None and f.f_code is not ClefModel.decide.__code__:
                depth += f.f_code.co_filename.startswith(PACKAGE)
                f = f.f_back
            depths.append(depth + 1)

    sys.setprofile(profile)
    try:
        model.decide(request)
    finally:
        sys.setprofile(None)
    return len(depths), max(depths)


out = {}
request = json.loads(sys.argv[1])
with tempfile.TemporaryDirectory() as tmp:
    from clef_local.testing import build_tiny_release

    for backbone in ("llama", "qwen3_5"):
        path = build_tiny_release(Path(tmp) / backbone, backbone=backbone)
        out[backbone] = frames(clef_local.load(path, dtype="float32"), request)

from clef_local.data.datasets import banking77_intents, banking77_request, banking77_rows
from clef_local.demo.default import default_model_path

triage = json.loads((Path(clef_local.__file__).parent / "demo" / "examples" / "triage.json").read_text())
b77 = banking77_request(banking77_rows("test")[0][0], list(banking77_intents()))
path = default_model_path()
began = time.perf_counter()
model = clef_local.load(path)
out["load_s"] = time.perf_counter() - began
for name, req in (("first_ms", triage), ("b77_cold_ms", b77), ("b77_again_ms", b77)):
    began = time.perf_counter()
    model.decide(req)
    out[name] = 1e3 * (time.perf_counter() - began)
out["tokens"] = len(model.encode(b77).input_ids)
print(json.dumps(out))
'''

REQUEST = {"model": "m", "state": "I was charged twice for my coffee this morning.",
           "questions": {"refund": {"type": "noul", "instructions": "Does the customer want money back?"},
                         "team": {"type": "choice", "criteria": {"cards": "Card payments", "transfers": None}}}}


def measure(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(REQUEST)], env=env, cwd=tree,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: the measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", type=Path, help="a source tree (default: this checkout)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per tree, alternated")
    args = parser.parse_args(argv)
    trees = [t.resolve() for t in (args.tree or [Path(__file__).resolve().parents[1]])]
    runs: dict[Path, list[dict]] = {t: [] for t in trees}
    for _ in range(args.repeats):
        for tree in trees:
            runs[tree].append(measure(tree))
    print("| tree | llama: forwards, frames | Qwen3.5: forwards, frames | demo load s | first decide ms "
          "| 77-way cold ms | 77-way again ms |")
    print("|---|---|---|---:|---:|---:|---:|")
    for tree, results in runs.items():
        def med(key: str, results: list[dict] = results) -> float:
            return statistics.median(r[key] for r in results)

        first = results[0]
        print(f"| {tree} | {first['llama'][0]}, {first['llama'][1]} | {first['qwen3_5'][0]}, {first['qwen3_5'][1]} "
              f"| {med('load_s'):.2f} | {med('first_ms'):,.0f} | {med('b77_cold_ms'):,.0f} "
              f"| {med('b77_again_ms'):,.0f} |")
    print(f"\n77-way request: {runs[trees[0]][0]['tokens']} tokens; medians of {args.repeats} fresh processes per tree")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
