"""The flagship scenarios on a GPU, from synthetic full-size releases (run by benchmarks/gpu_check.sh).

    python benchmarks/flagship.py --out OUT                  # on a CUDA machine (an H200: ≤ 8 minutes)
    python benchmarks/flagship.py --out OUT --dry-run        # tiny shapes on the CPU: the whole script, in CI time

Builds Clef 27B int4 / int8 and Clef-flash BF16 / int4 with random weights of the exact shapes
(:func:`clef_local.testing.build_shaped_release`) and runs, each step in its own process (a CUDA allocator cap is
per process; the reference gated-delta-net path needs transformers imported without flash-linear-attention):

(a) Clef 27B int4 under a 24 GiB cap (``max_memory`` + ``torch.cuda.set_per_process_memory_fraction``: an
    RTX 4090) at 4K and 16K tokens: fits?, peak memory (allocator's peak reserved + what the CUDA context holds)
    vs the planner's need at that length, prefill latency;
(b) Clef 27B int8 split over two simulated 24 GiB cards (``cuda:0,cuda:0`` with a 48 GiB cap: each stage is
    planned against 24 GiB) at 16K: per stage, its resident weights + its activation peak vs the plan;
(c) Clef-flash BF16 and int4 on the whole card: median latency at 512 / 2K / 8K tokens, tokens/s, and the share of
    the H200's BF16 peak (989 TFLOP/s; FLOPs = 2 × text-model parameters × tokens); the gated delta net with
    flash-linear-attention and with transformers' reference PyTorch path;
(d) the tests marked ``cuda``; and a per-layer table of the quantized kernels on Clef 27B's layer shapes.

Each step writes ``OUT/results/STEP.json``; a rerun skips the steps that have one (resumable when cut), and
releases are built once (a release is complete when its manifest exists, which is written last) and deleted when
no pending step needs them (the H200 has 64 GiB of disk). ``--budget-s`` stops starting steps when time is short.
Prints one table and writes it to ``OUT/flagship.md`` (the kernel table to ``OUT/kernels.md``). Anything not
measured says "not run" and why; nothing is estimated in its place.
Table in docs/benchmarks.md#flagship-desks-full-size-shapes-two-cards-caps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GiB = 1 << 30
H200_BF16_TFLOPS = 989.0
FULL = {"contexts_a": (4096, 16384), "context_b": 16384, "contexts_c": (512, 2048, 8192), "gdn": 2048,
        "repeats": 3, "kernel_tokens": 2048, "device": "cuda:0", "configs": {"clef": "clef", "flash": "clef-flash"}}
# the request's prompt and two questions take ~280 tokens of the synthetic releases' tokenizer: contexts start above
DRY = {"contexts_a": (320, 448), "context_b": 448, "contexts_c": (320, 384, 512), "gdn": 384, "repeats": 2,
       "kernel_tokens": 32, "device": "cpu", "configs": {}}
RELEASES = {"clef-int4": ("clef", "int4"), "clef-int8": ("clef", "int8"), "flash-bf16": ("flash", "bf16"),
            "flash-int4": ("flash", "int4")}
# step → (the releases it needs, its label); in the order they run (most important first: the budget may cut)
STEPS = {
    "cuda-tests": ((), "(d) tests marked cuda"),
    "kernels": ((), "quantized kernels, one layer"),
    "a": (("clef-int4",), "(a) Clef 27B int4, 24 GiB cap"),
    "c-bf16": (("flash-bf16",), "(c) Clef-flash BF16, whole card"),
    "c-int4": (("flash-int4",), "(c) Clef-flash int4, whole card"),
    "gdn-reference": (("flash-bf16",), "(c) gated delta net, reference PyTorch path"),
    "b": (("clef-int8",), "(b) Clef 27B int8, 2 × 24 GiB simulated"),
}
STATE_WORDS = ("card", "payment", "refund", "charged", "twice", "store", "account", "transfer", "blocked", "fee",
               "yesterday", "balance", "support", "urgent", "customer", "declined", "airport", "euro", "limit")


def settings(dry_run: bool) -> dict[str, Any]:
    return DRY if dry_run else FULL


def cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# ---------------------------------------------------------------------------------------------------- releases
def tiny_config(work: Path) -> Path:
    """The tiny release's config (hidden 64, 4 layers) standing in for both shapes in a dry run."""
    from clef_local.testing import build_tiny_release

    source = work / "tiny-source"
    if not (source / "config.json").is_file():
        shutil.rmtree(source, ignore_errors=True)
        build_tiny_release(source)
    return source / "config.json"


def release(work: Path, name: str, dry_run: bool) -> tuple[Path, dict[str, Any]]:
    """The release ``name`` under ``work`` (built unless complete) and how it was built."""
    from clef_local.planning.planner import packaged_config
    from clef_local.testing import build_shaped_release

    path = work / name
    shape, scheme = RELEASES[name]
    info: dict[str, Any] = {"release": name, "scheme": scheme}
    if (path / "clef_local_manifest.json").is_file():
        return path, {**info, "built": "reused"}
    shutil.rmtree(path, ignore_errors=True)
    config = tiny_config(work) if dry_run else packaged_config(settings(False)["configs"][shape])
    started = time.perf_counter()
    build_shaped_release(config, path, scheme=scheme, hashes=False)
    seconds = time.perf_counter() - started
    size = sum(f.stat().st_size for f in path.iterdir())
    return path, {**info, "built_s": round(seconds, 1), "built_gib": round(size / GiB, 2)}


# ------------------------------------------------------------------------------------------------- measuring
def request_of(model: Any, tokens: int) -> tuple[dict[str, Any], int]:
    """A two-question request of exactly ``tokens`` tokens: a long state cut by the encoder at ``max_length``."""
    words = " ".join(STATE_WORDS[(i * 7 + i // 5) % len(STATE_WORDS)] for i in range(tokens * 2))
    request = {"model": "clef", "state": words,
               "questions": {"refund": {"type": "noul", "instructions": "Does the customer want money back?"},
                             "team": {"type": "choice", "criteria": {"cards": "Card payments", "transfers": None}}}}
    model.encoder.max_length = tokens  # the context the state is cut to
    encoded = model.encode(request, truncate_state=True)
    return request, len(encoded.input_ids)


def timed(model: Any, request: dict[str, Any], repeats: int, warm_up: bool = True) -> float:
    """Median seconds of one prefill + head (after a warm-up): ``predict`` returns numpy, so it has synchronised."""
    if warm_up:
        model.predict([request], truncate_state=True)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        model.predict([request], truncate_state=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def text_params(path: Path) -> int:
    """Parameters of the text model without the embeddings (the FLOP count's ``params``)."""
    from clef_local.planning.census import census_from_config

    params = census_from_config(path / "config.json", "bf16").params
    return params["text_linears"] + params["text_other"]


def memory_probe() -> dict[str, Any]:
    """The CUDA context's share of the card (held outside torch's allocator), before anything is loaded."""
    import torch

    if not cuda():
        return {}
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    return {"outside": total - free - torch.cuda.memory_reserved(), "total": total}


def peak_bytes(probe: dict[str, Any]) -> int | None:
    import torch

    return torch.cuda.max_memory_reserved() + probe["outside"] if probe else None


def plan_need(model: Any, context: int) -> int:
    """The loader's plan (the stored format as the chosen backend holds it) at ``context`` tokens."""
    from clef_local.planning.choice import resident_plan
    from clef_local.planning.planner import footprint_from_release

    decision = model.backend.load_decision
    footprint = footprint_from_release(model.path)
    hardware = _decision_hardware(decision)
    return resident_plan(footprint.censuses[decision.scheme], footprint, hardware, decision, context).need


def _decision_hardware(decision: Any) -> Any:
    from clef_local.planning.hardware import detect

    return detect(decision.device.split(",")[0])


# ------------------------------------------------------------------------------------------------------ steps
def step_a(work: Path, dry_run: bool) -> dict[str, Any]:
    import torch

    import clef_local
    from clef_local.errors import InsufficientMemoryError

    out_of_memory = (torch.cuda.OutOfMemoryError,)
    s = settings(dry_run)
    probe = memory_probe()
    path, built = release(work, "clef-int4", dry_run)
    rows = []
    try:
        model = clef_local.load(path, device=s["device"], max_memory={s["device"]: "24GiB"})
    except (InsufficientMemoryError, *out_of_memory) as exc:  # the scenario's answer, not a crash of the script
        return {"built": built, "rows": [{"scenario": f"(a) Clef 27B int4, 24 GiB cap, {c:,} tokens", "fits": "no",
                                          "note": f"load failed: {type(exc).__name__}: {str(exc)[:200]}"}
                                         for c in s["contexts_a"]]}
    for context in s["contexts_a"]:
        row: dict[str, Any] = {"scenario": f"(a) Clef 27B int4, 24 GiB cap, {context:,} tokens"}
        try:
            request, tokens = request_of(model, context)
            if probe:
                import torch

                torch.cuda.reset_peak_memory_stats()
            long = context > 8192  # one run: a 16K prefill of 27B takes seconds, the shorter one warmed up
            seconds = timed(model, request, 1 if long else s["repeats"], warm_up=not long)
            peak = peak_bytes(probe)
            row.update(fits="yes" if peak is None or peak <= 24 * GiB else "no (over the cap)", tokens=tokens,
                       latency_ms=1e3 * seconds, tokens_s=tokens / seconds, peak=peak, plan=plan_need(model, tokens),
                       note=f"kernels {model.describe().get('kernels')}")
        except out_of_memory as exc:  # under the cap, the answer is "does not fit"
            row.update(fits="no (out of memory)", note=f"{type(exc).__name__}: {str(exc)[:200]}")
        rows.append(row)
    return {"built": built, "rows": rows}


def step_c(work: Path, dry_run: bool, name: str) -> dict[str, Any]:
    import clef_local

    s = settings(dry_run)
    path, built = release(work, name, dry_run)
    model = clef_local.load(path, device=s["device"])
    params = text_params(path)
    paths = model.describe().get("linear_attention", {})
    contexts = (s["gdn"],) if name == "flash-bf16" and os.environ.get("CLEF_GDN_REFERENCE") else s["contexts_c"]
    label = "(c) gated delta net, reference path" if os.environ.get("CLEF_GDN_REFERENCE") else \
        f"(c) Clef-flash {RELEASES[name][1]}"
    rows = []
    for context in contexts:
        request, tokens = request_of(model, context)
        seconds = timed(model, request, s["repeats"])
        flops = 2 * params * tokens
        rows.append({"scenario": f"{label}, {context:,} tokens", "fits": "yes", "tokens": tokens,
                     "latency_ms": 1e3 * seconds, "tokens_s": tokens / seconds,
                     "share": flops / seconds / (H200_BF16_TFLOPS * 1e12) if cuda() else None,
                     "note": f"gated delta net: {paths.get('chunk_gated_delta_rule', '?')}"})
    return {"built": built, "rows": rows}


def step_b(work: Path, dry_run: bool) -> dict[str, Any]:
    import clef_local

    s = settings(dry_run)
    probe = memory_probe()
    path, built = release(work, "clef-int8", dry_run)
    device = "cpu,cpu" if dry_run else "cuda:0,cuda:0"
    caps = {"cpu": "48GiB"} if dry_run else {"cuda:0": "48GiB"}
    model = clef_local.load(path, device=device, max_memory=caps)
    backbone = model.backend.backbone
    stages = stage_meter(model, bool(probe))
    request, tokens = request_of(model, s["context_b"])
    seconds = timed(model, request, 1, warm_up=False)  # the memory is the question here; one 16K prefill
    plan = plan_split(model, tokens)
    rows = []
    for i, (stage, planned) in enumerate(zip(stages, plan.stages, strict=True)):
        # a card of its own would hold its weights, its activations' peak and a CUDA context of its own
        peak = stage["weights"] + stage["rise"] + probe["outside"] if probe else None
        rows.append({"scenario": f"(b) Clef 27B int8 stage {i} (layers {stage['layers'][0]}-{stage['layers'][1] - 1})"
                                 f" of 2 × 24 GiB, {tokens:,} tokens",
                     "fits": ("yes" if peak <= 24 * GiB else "no") if peak is not None else "not run (no CUDA)",
                     "tokens": tokens, "latency_ms": 1e3 * seconds if i == 0 else None, "peak": peak,
                     "plan": planned.need, "note": f"split {backbone.split}"})
    return {"built": built, "rows": rows}


def plan_split(model: Any, context: int) -> Any:
    from clef_local.planning.caps import parse_max_memory, resolve_devices
    from clef_local.planning.choice import resident_split
    from clef_local.planning.hardware import named_device
    from clef_local.planning.planner import footprint_from_release

    decision = model.backend.load_decision
    footprint = footprint_from_release(model.path)
    cards = resolve_devices("24GiB,24GiB", parse_max_memory(None), named_device)
    return resident_split(footprint.censuses[decision.scheme], footprint, cards, decision, context)


def stage_meter(model: Any, on_cuda: bool) -> list[dict[str, Any]]:
    """Per pipeline stage: resident bytes (its layers; + the norm and the head on the last) and, on CUDA, the
    allocator's rise while its layers (and, last, the head) run, filled in by hooks during the next forward."""
    import torch

    backbone = model.backend.backbone
    layers = backbone.text_model.layers
    stages = []
    for index, (_, start, stop) in enumerate(backbone.split):
        modules = [layers[i] for i in range(start, stop)]
        if index == 0:  # the vision tower sits on the first card (the plan counts it there)
            modules += [m for m in (getattr(backbone.model.model, "visual", None),) if m is not None]
        if index == len(backbone.split) - 1:
            modules += [backbone.text_model.norm, model.backend.head]
        weights = sum(t.numel() * t.element_size() for m in modules for t in [*m.parameters(), *m.buffers()])
        stage = {"layers": (start, stop), "weights": weights, "rise": 0}
        if on_cuda:
            def begin(module: Any, args: Any, stage: dict[str, Any] = stage) -> None:
                torch.cuda.synchronize()
                stage["start"] = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()

            def end(module: Any, args: Any, output: Any, stage: dict[str, Any] = stage) -> None:
                torch.cuda.synchronize()
                stage["rise"] = max(stage["rise"], torch.cuda.max_memory_allocated() - stage["start"])

            layers[start].register_forward_pre_hook(begin)
            (model.backend.head if index == len(backbone.split) - 1 else layers[stop - 1]).register_forward_hook(end)
        stages.append(stage)
    return stages


def step_kernels(work: Path, dry_run: bool) -> dict[str, Any]:
    """Median time of each quantized kernel on Clef 27B's linear layers, and bf16's, at ``kernel_tokens`` tokens."""
    import torch
    from torch import nn

    from clef_local.backends import quantized as ql
    from clef_local.synthetic import quantized_tensors, tensor_values

    s = settings(dry_run)
    device = s["device"]
    shapes = ({"mlp gate/up": (17408, 5120), "mlp down": (5120, 17408), "gdn in_proj_qkv": (10240, 5120),
               "gdn in_proj_z": (6144, 5120), "gdn out_proj": (5120, 6144)} if not dry_run else
              {"mlp gate/up": (256, 128), "mlp down": (128, 256)})
    repeat = {"mlp gate/up": 2}  # gate and up: two matmuls of one shape per layer
    x_all = {k: torch.randn(s["kernel_tokens"], i, device=device, dtype=torch.bfloat16) for k, (o, i) in shapes.items()}
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    rows, detail = [], []
    for scheme, force in (("bf16", ""), ("int4", ""), ("int8", ""), ("int8", "int_mm"), ("fp8", ""), ("nf4", "")):
        total, kernels = 0.0, set()
        name = f"kernels {scheme}{f' ({force})' if force else ''}"
        if scheme == "nf4" and importlib.util.find_spec("bitsandbytes") is None:
            rows.append({"scenario": name, "fits": "not run (bitsandbytes is not installed)"})
            continue
        for label, (out_f, in_f) in shapes.items():
            with torch.device("meta"):
                model = nn.Sequential(nn.Linear(in_f, out_f, bias=False))
            if scheme == "bf16":
                layer: Any = nn.Linear(in_f, out_f, bias=False, device=device, dtype=torch.bfloat16)
                kernel = "F.linear"
            else:
                stored = quantized_tensors(scheme, "w.weight", out_f, in_f, 0.02, 64)
                state = {f"0.{t.name.removeprefix('w.')}": torch.from_numpy(tensor_values(t))
                         .view(_torch_dtype(t.dtype)) for t in stored}
                headers = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
                ql.swap_linears(model, ql.quantized_prefixes(headers, scheme), headers, dtype=torch.bfloat16)
                model.load_state_dict(state, strict=True, assign=True)
                model.to(device)
                ql.prepare_quantized(model)
                if force == "int_mm":  # torch._int_mm, the kernel without bitsandbytes, beside bnb's
                    model[0].use_int_mm()
                layer, kernel = model[0], model[0].kernel
            x = x_all[label]
            with torch.inference_mode():
                ms = _median_ms(lambda layer=layer, x=x: layer(x), s["repeats"] + 2, sync)
            kernels.add(kernel)
            total += ms * repeat.get(label, 1)
            flops = 2 * s["kernel_tokens"] * out_f * in_f
            detail.append(f"| {scheme} | {kernel} | {label} [{out_f}, {in_f}] | {ms:.3f} | "
                          f"{flops / (ms * 1e-3) / 1e12:.2f} |")
        rows.append({"scenario": f"{name}: one Clef 27B linear-attention layer's matmuls, "
                                 f"{s['kernel_tokens']:,} tokens", "fits": "-", "latency_ms": total,
                     "tokens_s": s["kernel_tokens"] / total * 1e3,
                     "note": ", ".join(sorted(kernels)) + f" on {device}"})
    return {"rows": rows, "detail": detail}


def _torch_dtype(name: str) -> Any:
    import torch

    return {"U32": torch.uint32, "I8": torch.int8, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn,
            "F32": torch.float32, "BF16": torch.bfloat16}[name]


def _median_ms(fn: Any, repeats: int, sync: Any) -> float:
    from _timing import median_ms  # this script's folder is on sys.path when it runs

    return median_ms(fn, repeats, sync)


def step_cuda_tests(work: Path, dry_run: bool) -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                           *(["tests/test_cuda.py"] if dry_run else ["tests/"])], cwd=root, capture_output=True,
                          text=True)
    summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    fits = "not run (no CUDA: every test skipped)" if not cuda() else ("yes" if done.returncode == 0 else "FAILED")
    return {"rows": [{"scenario": "(d) tests marked cuda", "fits": fits, "note": summary}],
            "log": done.stdout[-20000:] + done.stderr[-5000:]}


RUNNERS = {"cuda-tests": step_cuda_tests, "kernels": step_kernels, "a": step_a, "b": step_b,
           "c-bf16": lambda w, d: step_c(w, d, "flash-bf16"), "c-int4": lambda w, d: step_c(w, d, "flash-int4"),
           "gdn-reference": lambda w, d: step_c(w, d, "flash-bf16")}


# ------------------------------------------------------------------------------------------------------ table
def _cell(value: Any, fmt: str, missing: str) -> str:
    return missing if value is None else format(value, fmt)


def render(results: dict[str, dict[str, Any]], pending: dict[str, str], dry_run: bool) -> str:
    """The one table: a row per measurement, a "not run" row (with the reason) per step that did not finish."""
    no_gpu = "not run (no CUDA)"
    lines = ["DRY RUN: tiny shapes on the CPU; the numbers test the script, not the hardware.\n" if dry_run else "",
             "| scenario | fits? | peak GiB (plan GiB) | latency ms | tokens/s | share of H200 BF16 peak | notes |",
             "|---|---|---|---:|---:|---:|---|"]
    for name, (_, label) in STEPS.items():
        if name in pending:
            lines.append(f"| {label} | not run ({pending[name]}) | | | | | |")
            continue
        result = results[name]
        for row in result["rows"]:
            peak = row.get("peak")
            memory = (f"{peak / GiB:.1f} ({row['plan'] / GiB:.1f})" if peak is not None and row.get("plan")
                      else f"{no_gpu} (plan {row['plan'] / GiB:.1f})" if row.get("plan") else "")
            share = _cell(row.get("share"), ".1%", no_gpu) if name.startswith(("c-", "gdn")) else ""
            lines.append(f"| {row['scenario']} | {row.get('fits', '')} | {memory} | "
                         f"{_cell(row.get('latency_ms'), '.1f', '')} | {_cell(row.get('tokens_s'), ',.0f', '')} | "
                         f"{share} | {row.get('note', '')} |")
        if built := result.get("built"):
            how = (f"{built['built_gib']} GiB written in {built['built_s']} s" if "built_s" in built
                   else "built by an earlier run")
            lines.append(f"| build {built['release']} (synthetic, {built['scheme']}) | - | | | | | {how} |")
    if not any("fla" in row.get("note", "") for r in results.values() for row in r.get("rows", [])):
        why = ("flash-linear-attention is not installed here: pip install 'clef-local[cuda]', or its wheels in "
               ".gpu/wheels" if importlib.util.find_spec("fla") is None else
               "the Clef-flash BF16 step, which runs it, did not run" if "c-bf16" in pending else
               "flash-linear-attention is installed but transformers did not use it: see the Clef-flash BF16 rows")
        lines.append(f"| (c) gated delta net, flash-linear-attention | not run ({why}) | | | | | |")
    return "\n".join(lines).lstrip("\n") + "\n"


# ------------------------------------------------------------------------------------------------------ main
def run_step(name: str, work: Path, out: Path, dry_run: bool) -> int:
    if os.environ.get("CLEF_GDN_REFERENCE"):  # before transformers is imported: its kernels resolve at import
        sys.modules["fla"] = None  # type: ignore[assignment]
        sys.modules["causal_conv1d"] = None  # type: ignore[assignment]
    result = RUNNERS[name](work, dry_run)
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "results" / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results, the table (small files)")
    parser.add_argument("--work", type=Path, help="where the releases are built (default: OUT/../flagship-work)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--budget-s", type=float, default=450, help="start no step after this many seconds")
    parser.add_argument("--only", help="comma-separated steps: " + ", ".join(STEPS))
    parser.add_argument("--step", choices=list(STEPS), help=argparse.SUPPRESS)  # one step, in this process
    args = parser.parse_args(argv)
    work = args.work or args.out.parent / "flagship-work"
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.step:
        return run_step(args.step, work, args.out, args.dry_run)
    started = time.perf_counter()
    wanted = [s for s in STEPS if not args.only or s in args.only.split(",")]
    pending: dict[str, str] = {s: "not asked for (--only)" for s in STEPS if s not in wanted}
    for name in wanted:
        if (args.out / "results" / f"{name}.json").is_file():
            continue  # done in an earlier run
        left = args.budget_s - (time.perf_counter() - started)
        if left < 20:
            pending[name] = "time budget spent; rerun to resume"
            continue
        env = {**os.environ, **({"CLEF_GDN_REFERENCE": "1"} if name == "gdn-reference" else {})}
        command = [sys.executable, __file__, "--step", name, "--out", str(args.out), "--work", str(work),
                   *(["--dry-run"] if args.dry_run else [])]
        print(f"== {name}: {STEPS[name][1]} ({left:.0f} s of budget left)", flush=True)
        try:
            done = subprocess.run(command, env=env, timeout=left)
            if done.returncode:
                pending[name] = f"failed with exit code {done.returncode}; see the log"
        except subprocess.TimeoutExpired:
            pending[name] = f"cut by the time budget after {left:.0f} s; rerun to resume"
        needed = {r for s in wanted if s not in pending and not (args.out / "results" / f"{s}.json").is_file()
                  for r in STEPS[s][0]} | {r for s in pending for r in STEPS[s][0]}
        for name_ in RELEASES:  # the disk holds one or two full-size releases at a time
            if name_ not in needed and (work / name_).exists():
                shutil.rmtree(work / name_)
    results = {s: json.loads((args.out / "results" / f"{s}.json").read_text()) for s in STEPS
               if s not in pending and (args.out / "results" / f"{s}.json").is_file()}
    pending.update({s: "no result" for s in STEPS if s not in results and s not in pending})
    table = render(results, pending, args.dry_run)
    print("\n" + table)
    (args.out / "flagship.md").write_text(table)
    if "kernels" in results:
        kernels = ("| scheme | kernel | layer [out, in] | ms | TFLOP/s |\n|---|---|---|---:|---:|\n"
                   + "\n".join(results["kernels"]["detail"]) + "\n")
        print(kernels)
        (args.out / "kernels.md").write_text(kernels)
    return 0 if not [p for p in pending.values() if p.startswith("failed")] else 1


if __name__ == "__main__":
    sys.exit(main())
