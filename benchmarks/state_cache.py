"""The state cache: a second schema on the same state costs its own tokens only (one table per part).

    python benchmarks/state_cache.py                               # all three parts
    python benchmarks/state_cache.py --part latency --repeats 3    # cold vs hit per state length
    python benchmarks/state_cache.py --part server --state-tokens 2048
    python benchmarks/state_cache.py --part parity

- **latency**: the demo model (Llama backbone) and a tiny Qwen3.5 release, states of 512 / 2K / 8K tokens (the demo's
  context is 8,192, so its "8K" state is 8,192 minus the schema), a 3-question schema (noul, choice, score).
  *cold*: ``decide`` with the cache off; *miss*: the first ``decide`` on a state with the cache on (the state pass
  is saved); *hit*: another, different 3-question schema on the same state ("schema tokens": what runs after the
  state, the cold request's / the hit's). Medians over ``--repeats`` runs (each hit a schema not seen before), in
  the loader's dtype for this machine unless ``--dtype``. On a small shared machine set ``OMP_NUM_THREADS=1``: two
  torch threads on an oversubscribed CPU wait on each other at every op.
- **server**: ``create_app`` on a loopback port (in process), 8 states × 4 schemas sent by 4 concurrent clients
  (each client takes every 4th request of the schema-major list, so the first wave is all misses), with and
  without the cache: throughput, the ratio, the hit rate from ``/metrics``, the cache's bytes vs its budget and the
  process's peak RSS.
- **parity**: max |Δp| of a hit vs a cold pass over 60 varied requests (12 states × 5 schemas, float32) per backbone
  kind: tiny Llama, tiny Qwen3.5 and the demo model (Llama), batched by 8 on the hit side; and the tiny vision
  release (Qwen3.5 with its vision tower) with 1–3 images of varied sizes in each of the 12 states
  (``--releases vision`` runs that row alone).
Tables in docs/benchmarks.md#state-cache.
"""

from __future__ import annotations

import argparse
import base64
import io
import random
import resource
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

import clef_local
from clef_local.demo.default import default_model_path
from clef_local.testing import build_tiny_release

WORDS = ("customer", "card", "declined", "refund", "twice", "charged", "coffee", "store", "manager", "account",
         "balance", "transfer", "pending", "urgent", "please", "help", "yesterday", "again", "the", "my", "was", "and")
SCHEMAS: list[dict[str, Any]] = [
    {"refund": {"type": "noul", "instructions": "Does the customer want money back?"},
     "team": {"type": "choice", "criteria": {"cards": "Card payments", "transfers": "Bank transfers", "other": None}},
     "urgency": {"type": "score", "criteria": ["low", "medium", "high"]}},
]


def schema(seed: int) -> dict[str, Any]:
    """A 3-question schema (noul, choice, score) whose wording varies with ``seed`` (0 is :data:`SCHEMAS`)."""
    if seed == 0:
        return SCHEMAS[0]
    rng = random.Random(seed)
    topic = rng.choice(["fraud", "fees", "delivery", "login", "limits", "cards", "loans"])
    teams = rng.sample(["billing", "cards", "risk", "support"], 3)
    return {f"is_{topic}_{seed}": {"type": "noul", "instructions": f"Is this about {topic} (case {seed})?"},
            f"route_{seed}": {"type": "choice", "criteria": {t: f"The {t} team" for t in teams}},
            f"tone_{seed}": {"type": "score", "criteria": ["calm", "annoyed", "angry", "furious"][: rng.randint(2, 4)]}}


def request(state: str, seed: int) -> dict[str, Any]:
    return {"model": "clef-local", "state": state, "questions": schema(seed)}


# varied states for the parity part: unicode, JSON objects and arrays, empty, long
STATES: list[Any] = [
    "I was charged twice for the same coffee this morning.", "Mon virement n'est jamais arrivé 😡 — vérifiez ?",
    "转账失败了，请帮我查一下。", {"customer": "Ana", "messages": ["card declined", "at the airport"], "vip": True},
    ["first line", {"nested": None, "n": 3}, 7, False], "", "Emoji only: 🚀🔥💳🏦", {"b": 1, "a": {"z": "ünï"}},
    "x" * 300, "Line one\nLine two\n\tTabbed \"quoted\" text with <|im_end|> inside",
    "A much longer ticket thread, message after message. " * 40,
    {"trace": [f"step {i}: tool call returned ok" for i in range(60)]},
]


# (width, height) of the parity part's images: square, wide, tall, tiny, odd
IMAGE_SIZES = [(64, 64), (320, 96), (90, 280), (17, 23), (257, 129), (120, 200)]


def image_uri(width: int, height: int, seed: int) -> str:
    """A PNG data URI: a smooth gradient plus noise (so that resizing and patches carry signal)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1), (x + y) * 127 / max(width + height, 1)], -1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def parity_requests(images: bool) -> list[dict[str, Any]]:
    """12 states × 5 schemas (seed 0: :data:`SCHEMAS`); with ``images`` each state carries 1–3 images."""
    out = []
    for i, state in enumerate(STATES):
        media = ([image_uri(*IMAGE_SIZES[(i + 2 * k) % len(IMAGE_SIZES)], seed=10 * i + k) for k in range(1 + i % 3)]
                 if images else [])
        for k in range(5):
            body: dict[str, Any] = {"model": "clef-local", "state": state, "questions": schema(5 * i + k)}
            if media:
                body["images"] = media
            out.append(body)
    return out


def state_of(model: clef_local.ClefModel, tokens: int, seed: int = 0) -> str:
    """A ticket-like text state of exactly ``tokens`` tokens (as encoded in a request) when the tokenizer allows."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(tokens * 2)]
    lo, hi = 0, len(words)
    while lo < hi:  # the most words whose text has at most `tokens` tokens
        mid = (lo + hi + 1) // 2
        if len(model.tokenizer.encode_pieces([" ".join(words[:mid])])[0]) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - started)


def latency(models: dict[str, Path], sizes: list[int], repeats: int, dtype: str | None) -> None:
    print("| model | dtype | state tokens | schema tokens | cold ms | miss ms | hit ms | hit / cold |")
    print("|---|---|---|---|---|---|---|---|")
    for name, path in models.items():
        cold = clef_local.load(path, dtype=dtype, state_cache=0)
        warm = clef_local.load(path, dtype=dtype, state_cache="2GiB")
        context = cold.max_length
        for size in sizes:
            empty = cold.encode(request("", 0))
            target = min(size, context - (len(empty.input_ids) - empty.state_tokens) - 64)  # room for the schemas
            cold_ms, miss_ms, hit_ms = [], [], []
            for model in (cold, warm):  # warm-up (first-call allocations, lazy imports), then an empty cache
                model.decide(request(state_of(cold, 64, seed=99), 0))
                model.decide(request(state_of(cold, 64, seed=99), 1))
            warm.state_cache.clear()
            for rep in range(repeats):
                state = state_of(cold, target, seed=rep)
                cold_ms.append(timed(lambda: cold.decide(request(state, 0))))  # noqa: B023
                miss_ms.append(timed(lambda: warm.decide(request(state, 0))))  # noqa: B023
                hit_ms.append(timed(lambda: warm.decide(request(state, 1000 + rep))))  # noqa: B023
            encoded = cold.encode(request(state_of(cold, target, seed=0), 0))[1]
            hit_schema = cold.encode(request(state_of(cold, target, seed=0), 1000))[1]
            after = [len(e.input_ids) - e.state_start - e.state_tokens for e in (encoded, hit_schema)]
            c, m, h = (statistics.median(x) for x in (cold_ms, miss_ms, hit_ms))
            print(f"| {name} | {str(cold.backend.backbone.dtype).split('.')[-1]} | {encoded.state_tokens:,} | "
                  f"{after[0]} / {after[1]} | {c:,.0f} | {m:,.0f} | {h:,.0f} | "
                  f"1/{c / h:.1f} |", flush=True)
            warm.state_cache.clear()


def server(path: Path, state_tokens: int, dtype: str | None, budget: str) -> None:
    import httpx

    from clef_local.server import ServerConfig, ThreadedServer, create_app

    probe = clef_local.load(path, dtype=dtype, state_cache=0)
    states = [state_of(probe, state_tokens, seed=100 + i) for i in range(8)]
    requests = [request(states[s], 2000 + q) for q in range(4) for s in range(8)]  # schema-major: 8 misses first
    del probe
    print("| cache | requests | clients | wall s | requests/s | ratio | hit rate | cache bytes / budget | "
          "peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for size in ("0", budget):
        model = clef_local.load(path, dtype=dtype, state_cache=size)
        model.decide(request(state_of(model, 64, seed=99), 0))  # warm-up, then an empty cache
        model.state_cache.clear()
        hits0 = model.state_cache.stats()
        with ThreadedServer(create_app({"clef-local": model}, ServerConfig(max_batch=8, max_queue=256))) as running:
            errors: list[str] = []

            def client(index: int, url: str = running.url, errors: list[str] = errors) -> None:
                with httpx.Client(base_url=url, timeout=3600) as http:
                    for body in requests[index::4]:
                        response = http.post("/v1/systemone", json=body)
                        if response.status_code != 200:
                            errors.append(response.text[:200])

            threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wall = time.perf_counter() - started
        if errors:
            raise SystemExit(f"server errors: {errors[:3]}")
        stats = model.state_cache.stats()
        lookups = (stats.hits - hits0.hits) + (stats.misses - hits0.misses)
        rate = (stats.hits - hits0.hits) / lookups if lookups else 0.0
        throughput = len(requests) / wall
        base = base or throughput
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        used = (f"{stats.bytes / 2**20:,.1f} MiB / {stats.budget / 2**20:,.0f} MiB ({stats.entries} states)"
                if stats.budget else "off")
        print(f"| {'on' if stats.budget else 'off'} | {len(requests)} (8 states × 4 schemas, {state_tokens:,} "
              f"tokens) | 4 | {wall:,.1f} | {throughput:.2f} | {throughput / base:.1f}× | "
              f"{f'{rate:.0%}' if stats.budget else '-'} | {used} | {peak:,.0f} MiB |", flush=True)
        del model


def parity(models: dict[str, Path], with_images: set[str]) -> None:
    print("| backbone | release | requests | state passes | hits | max \\|Δp\\| hit vs cold (float32) |")
    print("|---|---|---|---|---|---|")
    for name, path in models.items():
        requests = parity_requests(images=name in with_images)
        cold = clef_local.load(path, dtype="float32", state_cache=0)
        warm = clef_local.load(path, dtype="float32", state_cache="1GiB")
        want = cold.predict(requests, batch_size=1)
        warm.predict(requests, batch_size=1)  # fills the cache: 12 misses, 48 hits
        got = warm.predict(requests, batch_size=8)  # all hits, shared states batched
        worst = max(float(np.abs(a - b).max()) for p, q in zip(got, want, strict=True)
                    for a, b in zip(p.probabilities, q.probabilities, strict=True))
        stats = warm.state_cache.stats()
        kind = ("Qwen3.5" if cold.release.is_qwen3_5 else "Llama") + (" + images" if name in with_images else "")
        print(f"| {kind} | {name} | {len(requests)} | {stats.misses} | {stats.hits} | {worst:.1e} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("latency", "server", "parity", "all"), default="all")
    parser.add_argument("--model", type=Path, help="the Llama-backbone model (default: the demo model)")
    parser.add_argument("--sizes", default="512,2048,8192", help="state lengths in tokens (latency)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per median (latency)")
    parser.add_argument("--state-tokens", type=int, default=2048, help="tokens per state (server)")
    parser.add_argument("--budget", default="1GiB", help="the state cache size with the cache on (server)")
    parser.add_argument("--dtype", default=None, help="compute dtype (default: the loader's choice)")
    parser.add_argument("--releases", default="llama,qwen,demo,vision",
                        help="the parity part's releases, of llama, qwen, demo, vision")
    args = parser.parse_args()
    demo = args.model or default_model_path()
    root = Path(tempfile.mkdtemp(prefix="clef-state-cache-"))
    tiny_qwen = build_tiny_release(root / "tiny-qwen3_5", backbone="qwen3_5", seed=0)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.part in ("latency", "all"):
        latency({demo.name: demo, "tiny Qwen3.5": tiny_qwen}, sizes, args.repeats, args.dtype)
    if args.part in ("server", "all"):
        server(demo, args.state_tokens, args.dtype, args.budget)
    if args.part in ("parity", "all"):
        wanted = set(args.releases.split(","))
        unknown = wanted - {"llama", "qwen", "demo", "vision"}
        if unknown:
            raise SystemExit(f"--releases: unknown {', '.join(sorted(unknown))}; use llama, qwen, demo, vision")
        releases: dict[str, Path] = {}
        if "llama" in wanted:
            releases["tiny llama"] = build_tiny_release(root / "tiny-llama", backbone="llama", seed=1)
        if "qwen" in wanted:
            releases["tiny Qwen3.5"] = tiny_qwen
        if "demo" in wanted:
            releases[demo.name] = demo
        if "vision" in wanted:
            releases["tiny vision"] = build_tiny_release(root / "tiny-vision", backbone="qwen3_5", seed=0,
                                                         vision=True)
        parity(releases, with_images={"tiny vision"})


if __name__ == "__main__":
    main()
