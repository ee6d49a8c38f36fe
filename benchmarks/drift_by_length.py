"""Drift of int8, int4 and nf4 variants against their BF16 reference as the state grows: does quantization error
build up over a long context? On the demo model and a tiny random Qwen3.5 release, one table.

    python benchmarks/drift_by_length.py                                        # full: 50, 1K, 4K, 16K tokens
    python benchmarks/drift_by_length.py --lengths 50 1000 --requests 4         # a check on a 2-core CPU

Each scheme is quantized once per model (``clef-local quantize --no-validate`` into ``--work``, kept for the next
run). The probe requests are customer conversation logs of about 50, 1K, 4K and 16K tokens by the model's own
tokenizer (``clef_local.data.probes.long_state_requests``: BANKING77 / NLU++ messages, each log asked a choice over
8-16 intents, two noul questions and a score). A length over a model's context is skipped and said so (the demo's
is 8,192 tokens: its 16K row is left out, not truncated). Mean KL(reference ‖ variant) carries a paired request
bootstrap interval and the flip rate a Clopper-Pearson one (clef_local.quality.intervals, through drift).

Then ``--validation-data`` end to end: the long-state requests written as JSONL and ``clef-local quantize --bits 4
--validation-data FILE`` run on the demo model through the CLI; its verdict is printed (int4: 16 requests of four
questions can show its 5% flip limit; int8's 1% needs ~500 questions, and fewer are refused before quantizing).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from clef_local.data.probes import long_state_requests
from clef_local.demo.default import default_model_path

SCHEMES = ("int8", "int4", "nf4")
MODELS = ("demo", "tiny-qwen3_5")


def model_paths(names: list[str], work: Path) -> dict[str, Path]:
    """The demo model (built into the cache on first use) and a tiny random Qwen3.5 release under ``work``."""
    paths = {}
    for name in names:
        if name == "demo":
            paths[name] = default_model_path()
        elif name == "tiny-qwen3_5":
            from clef_local.testing import build_tiny_release

            path = work / "tiny-qwen3_5"
            paths[name] = path if path.is_dir() else build_tiny_release(path, backbone="qwen3_5", seed=0)
        else:
            raise SystemExit(f"--models: {name!r} is not one of {', '.join(MODELS)}")
    return paths


def variant(reference: Path, name: str, scheme: str, work: Path) -> Path:
    """``work/<model>-<scheme>``, quantized with ``clef-local quantize --no-validate`` when missing."""
    from clef_local.export.quantize import main as quantize_main

    out = work / f"{name}-{scheme}"
    if not out.is_dir():
        code = quantize_main(["--model", str(reference), "--format", scheme, "--out", str(out), "--no-validate"])
        if code:
            raise SystemExit(f"quantize {name} {scheme} failed with exit code {code}")
    return out


def predict(path: Path, requests: dict[int, list[dict[str, Any]]], dtype: str, batch_size: int) -> dict[int, list]:
    """One model's predictions of each length's requests (loaded once; states are never cut)."""
    import clef_local

    model = clef_local.load(path, dtype=dtype)
    try:
        return {length: model.predict(reqs, batch_size=batch_size) for length, reqs in requests.items()}
    finally:
        del model
        gc.collect()


def measure(name: str, reference: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The table's rows for one model: every scheme at every length that fits its context."""
    import clef_local
    from clef_local.quality.drift import drift_from_predictions
    from clef_local.quality.intervals import IntervalSettings
    from clef_local.runtime.tokenizer import ReleaseTokenizer

    tokenizer = ReleaseTokenizer(reference)

    def count(text: str) -> int:
        return len(tokenizer.encode_pieces([text])[0])

    context = clef_local.load(reference, dtype=args.dtype).max_length
    requests, tokens = {}, {}
    for length in args.lengths:
        reqs = long_state_requests(args.requests, length, args.seed, count_tokens=count)
        states = [count(r["state"]) for r in reqs]
        if max(states) + 1024 > context:  # the questions and the template need room beside the state
            print(f"{name}: {length:,}-token states skipped: the context is {context:,} tokens", flush=True)
            continue
        requests[length], tokens[length] = reqs, sum(states) / len(states)
    settings = IntervalSettings(resamples=args.resamples)
    started = time.perf_counter()
    ref = predict(reference, requests, args.dtype, args.batch_size)
    print(f"{name}: reference on {sum(map(len, requests.values()))} requests in {time.perf_counter() - started:.0f} s",
          flush=True)
    rows = []
    for scheme in args.schemes:
        path = variant(reference, name, scheme, args.work)
        started = time.perf_counter()
        cand = predict(path, requests, args.dtype, args.batch_size)
        print(f"{name}: {scheme} in {time.perf_counter() - started:.0f} s", flush=True)
        for length, reqs in requests.items():
            result = drift_from_predictions(ref[length], cand[length], reqs, intervals=settings)
            rows.append({"model": name, "scheme": scheme, "state_tokens": tokens[length], "requests": len(reqs),
                         "questions": result.summary["questions"], "kl_mean": result.summary["kl_mean"],
                         "kl_interval": result.intervals["all"]["kl_mean"],
                         "flip_rate": result.summary["flip_rate"],
                         "flip_interval": result.intervals["all"]["flip_rate"]})
    return rows


def _interval(value: float, bounds: list[float | None], fmt: str) -> str:
    low, high = bounds
    shown = "—" if low is None or high is None else f"[{low:{fmt}}, {high:{fmt}}]"
    return f"{value:{fmt}} {shown}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | scheme | state tokens | requests | questions | mean KL [95%] | flip rate [95%] |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['scheme']} | {r['state_tokens']:,.0f} | {r['requests']} | "
                     f"{r['questions']} | {_interval(r['kl_mean'], r['kl_interval'], '.2e')} | "
                     f"{_interval(r['flip_rate'], r['flip_interval'], '.3f')} |")
    return "\n".join(lines)


def validation_data_run(reference: Path, args: argparse.Namespace) -> int:
    """``clef-local quantize --bits 4 --validation-data FILE`` on ``reference`` through the CLI, FILE holding
    long-state requests; prints the command, its verdict line and what validation.json recorded."""
    from clef_local.data.datasets import Example
    from clef_local.data.jsonl import write_jsonl
    from clef_local.runtime.tokenizer import ReleaseTokenizer

    tokenizer = ReleaseTokenizer(reference)
    length = min(args.validation_length, 6000)  # the demo's context is 8,192 tokens
    requests = long_state_requests(args.requests, length, args.seed + 1,
                                   count_tokens=lambda t: len(tokenizer.encode_pieces([t])[0]))
    data = args.work / "validation_data.jsonl"
    write_jsonl([Example(f"long-{i}", r) for i, r in enumerate(requests)], data)
    out = args.work / "validated-int4"
    command = [sys.executable, "-m", "clef_local.cli", "quantize", "--model", str(reference), "--bits", "4",
               "--out", str(out), "--force", "--validation-data", str(data)]
    print(f"\n{len(requests)} requests of ~{length:,}-token states → {data}\n$ clef-local " + " ".join(command[3:]),
          flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    verdict = [line for line in (done.stdout + done.stderr).splitlines()
               if "validation" in line or line.startswith("error:")]
    print("\n".join(verdict[-3:]) or done.stderr[-2000:])
    if done.returncode == 0:
        stored = json.loads((out / "validation.json").read_text())
        m = stored["metrics"]
        print(f"verdict: {stored['verdict']} on {stored['requests']} requests, "
              f"{stored['questions']} questions (mean_kl {m['mean_kl']:.2e}, flip_rate {m['flip_rate']:.3f}); "
              f"exit {done.returncode}")
    else:
        kept = out.with_name(out.name + ".validation.json")
        verdict = json.loads(kept.read_text())["verdict"] if kept.is_file() else "not run"
        print(f"verdict: {verdict}; exit {done.returncode}")
    return done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[50, 1000, 4000, 16000],
                        help="state lengths in tokens (default 50 1000 4000 16000)")
    parser.add_argument("--requests", type=int, default=16, help="requests per length (default 16)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated (default int8,int4,nf4)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: demo, tiny-qwen3_5")
    parser.add_argument("--dtype", default="float32", help="compute dtype of every model (default float32)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--validation-length", type=int, default=4000,
                        help="state tokens of the --validation-data requests (default 4000; at most 6000)")
    parser.add_argument("--no-validation-data", action="store_true", help="skip the --validation-data run")
    parser.add_argument("--work", type=Path, help="where the tiny release and the variants go (default: a temp "
                                                  "folder, removed afterwards)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON")
    args = parser.parse_args(argv)
    args.schemes = args.schemes.split(",")
    with tempfile.TemporaryDirectory(prefix="drift-by-length-") as scratch:
        args.work = (args.work or Path(scratch)).resolve()
        args.work.mkdir(parents=True, exist_ok=True)
        paths = model_paths(args.models.split(","), args.work)
        rows = [row for name, path in paths.items() for row in measure(name, path, args)]
        print()
        print(table(rows))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        code = 0
        if not args.no_validation_data:
            code = validation_data_run(default_model_path(), args)
    return code


if __name__ == "__main__":
    sys.exit(main())
