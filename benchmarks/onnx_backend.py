"""ONNX Runtime (fp32, int8, int4) against torch (fp32, bf16) on the demo model: latency, memory, install size.

    python benchmarks/onnx_backend.py                       # exports beside the cache on first use (~1.5 min each)
    python benchmarks/onnx_backend.py --model DIR --exports DIR --probes 16

1. The ONNX exports of the release (``clef-local export-onnx`` fp32, int8, int4), made once into ``--exports``; their
   validation against the torch backend (max relative |Δh|, max |Δp|, flips on ``--probes`` probes) is printed.
2. Per row, two fresh processes (one per request): load, one warm-up decide of the 3-question request, then ONE timed
   decide of the request (the 3-question request, or the 77-option BANKING77 request) and the process's peak RSS
   (``VmHWM``; Linux only).
   ONNX rows run with ``sys.modules["torch"] = None`` (what an ONNX-only install holds in memory). Ratios are
   against torch fp32 in the same run on the same machine.
3. Install size of each environment: the sum of the installed files (``importlib.metadata``) of the dependency
   closure of what a decision imports: ``onnxruntime`` + ``transformers`` + ``tokenizers`` + ``numpy`` for ONNX,
   ``torch`` + ``transformers`` + ``tokenizers`` + ``numpy`` + ``safetensors`` for torch (clef-local's other
   dependencies are common to both and left out).
Tables in docs/benchmarks.md#parity-with-the-reference and docs/benchmarks.md#backends.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from clef_local.data.datasets import banking77_intents, banking77_request, banking77_rows

THREE = {"model": "clef-local", "state": "My card payment was declined twice at the supermarket today.",
         "questions": {"complaint": {"type": "noul", "instructions": "Is the customer complaining?"},
                       "topic": {"type": "choice", "criteria": {"cards": None, "transfers": None, "account": None}},
                       "urgency": {"type": "score", "criteria": ["low", "medium", "high"]}}}
ROWS = (("torch", "float32", None), ("torch", "bfloat16", None), ("onnx", None, "fp32"), ("onnx", None, "int8"),
        ("onnx", None, "int4"))
_CHILD = """
import json, resource, sys, time
if sys.argv[2] == "onnx":
    sys.modules["torch"] = None
import clef_local
started = time.perf_counter()
model = clef_local.load(sys.argv[1], backend=sys.argv[2], dtype=None if sys.argv[3] == "-" else sys.argv[3])
load_s = time.perf_counter() - started
three, request = json.loads(sys.argv[4]), json.loads(sys.argv[5])
model.decide(three)
started = time.perf_counter()
answer = model.decide(request)
ms = 1e3 * (time.perf_counter() - started)
# VmHWM, not getrusage's ru_maxrss: Linux carries the parent's high-water mark into a forked and exec'd child
hwm = [int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")]
print(json.dumps({"ms": ms, "load_s": load_s, "tokens": answer["usage"]["input_tokens"],
                  "rss_mib": (hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024}))
"""


def banking_request() -> dict:
    """The first BANKING77 test message as a 77-option choice."""
    text, _gold = banking77_rows("test")[0]
    return banking77_request(text, list(banking77_intents()))


def ensure_exports(model: Path, root: Path, probes: int) -> dict[str, dict]:
    """``{format: validation}`` for the fp32/int8/int4 exports under ``root`` (exported when missing)."""
    from clef_local.export.onnx.export import export_onnx

    out = {}
    root.mkdir(parents=True, exist_ok=True)  # export-onnx never creates --out's parent
    for fmt in ("fp32", "int8", "int4"):
        path = root / fmt
        if not (path / "onnx" / "validation.json").is_file():
            summary = export_onnx(model, path, fmt, probes=probes, force=path.exists())
            print(f"exported {fmt} in {summary['seconds']:.0f} s", file=sys.stderr)
        out[fmt] = json.loads((path / "onnx" / "validation.json").read_text())
        out[fmt]["onnx_mb"] = sum(f.stat().st_size for f in (path / "onnx").iterdir()) / 1e6
    return out


def run_child(path: Path, backend: str, dtype: str | None, request: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path), backend, dtype or "-", json.dumps(THREE),
                           json.dumps(request)], capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{backend} {dtype}: {done.stderr[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _closure(roots: list[str]) -> set[str]:
    """Installed distributions needed by ``roots`` (hard requirements whose markers hold here; no extras)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def install_mb(roots: list[str]) -> tuple[float, list[str]]:
    total = 0
    names = sorted(_closure(roots))
    for name in names:
        for file in metadata.distribution(name).files or []:
            located = Path(file.locate())
            if located.is_file():
                total += located.stat().st_size
    return total / 1e6, names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="BF16 release (default: the built-in demo model)")
    parser.add_argument("--exports", type=Path, help="where the ONNX exports live (default: beside the model)")
    parser.add_argument("--probes", type=int, default=16, help="validation probes per export (default 16)")
    args = parser.parse_args(argv)
    if args.model is None:
        from clef_local.demo.default import default_model_path

        args.model = default_model_path()
    exports = args.exports or args.model.parent / f"{args.model.name}-onnx"
    validations = ensure_exports(args.model, exports, args.probes)

    print(f"\nONNX vs torch float32 on {args.model.name} ({args.probes} probes; tolerances: rel |Δh| ≤ 1e-4, "
          f"|Δp| ≤ 1e-3)\n")
    print("| format | onnx/ MB | max rel abs Δh | max abs Δp | mean KL | flips / questions |")
    print("|---|---:|---:|---:|---:|---:|")
    for fmt, v in validations.items():
        print(f"| {fmt} | {v['onnx_mb']:.0f} | {v['hidden_rel']:.2e} | {v['max_abs_dp']:.2e} | {v['mean_kl']:.1e} "
              f"| {v['flips']} / {v['questions']} |")

    requests = {"3 questions": THREE, "BANKING77, 77 options": banking_request()}
    results: dict[tuple[str, str], dict] = {}
    for backend, dtype, fmt in ROWS:
        label = f"torch {dtype}" if backend == "torch" else f"onnxruntime {fmt}"
        path = args.model if backend == "torch" else exports / fmt
        for name, request in requests.items():
            results[(label, name)] = run_child(path, backend, dtype, request)
            print(f"{label:18s} {name:22s} {results[(label, name)]}", file=sys.stderr)
    base = "torch float32"
    print("\nOne run each, fresh process per cell (peak RSS includes loading); ratios against torch float32.\n")
    print("| backend | " + " | ".join(f"{n}: ms (×) | {n}: peak RSS MiB (×)" for n in requests) + " |")
    print("|---|" + "---:|---:|" * len(requests))
    for label in dict.fromkeys(k[0] for k in results):
        cells = []
        for name in requests:
            r, b = results[(label, name)], results[(base, name)]
            cells.append(f"{r['ms']:.0f} ({r['ms'] / b['ms']:.2f}×) | {r['rss_mib']:.0f} "
                         f"({r['rss_mib'] / b['rss_mib']:.2f}×)")
        print(f"| {label} | " + " | ".join(cells) + " |")
    tokens = {name: results[(base, name)]["tokens"] for name in requests}
    print(f"\ninput tokens: {tokens}")

    onnx_mb, onnx_names = install_mb(["onnxruntime", "transformers", "tokenizers", "numpy"])
    torch_mb, torch_names = install_mb(["torch", "transformers", "tokenizers", "numpy", "safetensors"])
    print("\n| environment | distributions | installed MB |\n|---|---:|---:|")
    print(f"| ONNX only (onnxruntime, transformers, tokenizers, numpy + deps) | {len(onnx_names)} | {onnx_mb:,.0f} |")
    print(f"| torch (torch {metadata.version('torch')}, transformers, tokenizers, numpy, safetensors + deps) | "
          f"{len(torch_names)} | {torch_mb:,.0f} |")
    print(f"| ratio ONNX / torch | | {onnx_mb / torch_mb:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
