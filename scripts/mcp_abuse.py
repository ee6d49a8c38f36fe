"""A soak check, not a benchmark: 1,000 hostile MCP tool calls against ``clef-local mcp``, good calls among them.

    python scripts/mcp_abuse.py                                   # the default model over stdio, 1,000 calls
    python scripts/mcp_abuse.py --model DIR --calls 200 --transport http --json /tmp/mcp-abuse.json

The real command runs in its own process (over stdio, as a desktop host launches it, or ``--http`` on a free loopback
port with an API key), driven by the MCP SDK's own client. It serves two models: ``--model`` (default: the built-in
default model) as ``clef-local`` and a tiny random release with a vision tower as ``vision`` (``--vision DIR``, else
built into a temporary folder), so that bad images reach the image decoder instead of the text-only model's refusal.
A seeded generator builds ``--calls`` hostile calls of the kinds below, round-robin; a good call (the built-in
triage, moderation and routing examples, or an ``ask_again`` on a state sent before) goes after every ``--every``.

Kinds: malformed arguments (questions of the wrong shape, missing fields, unknown arguments), wrong types in every
argument, huge strings (1 to 10 MB states, questions, labels, ids, model names), bad images (not base64, garbage
bytes, truncated PNGs, a 64-megapixel header, a 1:300 aspect, URLs, paths, text data URIs, broken MCP image
blocks, too many), huge counts (65 questions, 256 options, 11 levels, 64 × 255 options, 65-deep JSON), ``ask_again``
abuse (unknown and malformed digests, bad questions for a known one), unknown tools, and odd Unicode (NUL, control
characters, combining marks, BOMs; not lone surrogates, which the SDK's client cannot send: tests/test_mcp.py sends
them, with NaN and broken JSON, as raw lines).

Prints, per kind, the calls sent and what came back (answers, tool errors by status, protocol errors, client
exceptions); the 5xx tool errors and lost calls (both must be 0); server RSS before, after each quarter and at the
end (and its peak); the good calls' p50 / p99 latency and whether the last one was answered. ``--json`` writes the
same summary. The last run's numbers: docs/benchmarks.md#mcp-hostile-calls.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import psutil

KEY = "mcp-abuse-key"
EXAMPLES = ("triage", "moderation", "routing")
ROOT = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024
Call = tuple[str, dict[str, Any]]  # (tool, arguments)


def examples() -> list[dict[str, Any]]:
    files = resources.files("clef_local.demo.examples")
    out = []
    for name in EXAMPLES:
        request = json.loads(files.joinpath(f"{name}.json").read_text())
        out.append({k: v for k, v in request.items() if k in ("state", "questions")})
    return out


GOOD = examples()
STATE = GOOD[0]["state"]
QUESTIONS = GOOD[0]["questions"]


# ---------------------------------------------------------------- images

def _png(size: tuple[int, int], mode: str = "RGB", noise: bool = False) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    if noise:  # incompressible: a cut file misses pixel data, not only its end marker
        Image.frombytes(mode, size, random.Random(1).randbytes(size[0] * size[1] * 3)).save(out, format="PNG")
    else:
        Image.new(mode, size).save(out, format="PNG")
    return out.getvalue()


_IMAGES: dict[str, str] = {}


def image(name: str) -> str:
    """Base64 of the named hostile image, built once."""
    if not _IMAGES:
        png = _png((40, 30))
        _IMAGES.update({
            "truncated": base64.b64encode(_png((64, 64), noise=True)[:6000]).decode(),
            "garbage": base64.b64encode(random.Random(0).randbytes(4096)).decode(),
            "bomb": base64.b64encode(_png((8000, 8000), "1")).decode(),  # 64 M pixels from a ~10 KB file
            "aspect": base64.b64encode(_png((1, 300))).decode(),
            "good": base64.b64encode(png).decode(),
            "huge": base64.b64encode(b"\x89PNG" + b"\0" * (12 * MiB)).decode(),
        })
    return _IMAGES[name]


# ---------------------------------------------------------------- the generator

def malformed(rng: random.Random) -> Call:
    variants: list[Call] = [
        ("decide", {"state": STATE, "questions": [QUESTIONS]}),
        ("decide", {"state": STATE, "questions": "refund?"}),
        ("decide", {"state": STATE, "questions": {}}),
        ("decide", {"state": STATE}),
        ("decide", {"questions": QUESTIONS}),
        ("decide", {}),
        ("decide", {"state": STATE, "questions": {"q": "noul"}}),
        ("decide", {"state": STATE, "questions": {"q": {}}}),
        ("decide", {"state": STATE, "questions": {"": {"type": "noul"}}}),
        ("decide", {"state": STATE, "questions": {"q": {"type": "box"}}}),
        ("decide", {"state": STATE, "questions": {"q": {"type": "choice"}}}),
        ("decide", {"state": STATE, "questions": {"q": {"type": "score", "criteria": {"0": "low", "1": "hi"}}}}),
        ("decide", {"state": STATE, "questions": {"q": {"type": "noul", "criteria": {"maybe": None}}}}),
        ("ask_yes_no", {"state": STATE}),
        ("ask_yes_no", {"state": STATE, "question": "refund?", "options": {"a": None}}),
        ("choose", {"state": STATE, "question": "which?"}),
        ("choose", {"state": STATE, "options": {"only": None}}),
        ("rate", {"state": STATE, "levels": ["one"]}),
        ("ask_again", {"questions": QUESTIONS}),
        ("models", {"extra": True}),
    ]
    return rng.choice(variants)


WRONG = [None, True, 0, -1, 3.5, 10 ** 30, [], [1, 2], {"a": {"b": []}}, ""]
RIGHT = {  # the values of WRONG that are right for an argument (null for an optional one, JSON for a state)
    "state": [[], [1, 2], {"a": {"b": []}}, ""], "model": [None], "images": [None, []], "videos": [None, []],
    "criteria": [None], "question": [None, "", [], [1, 2], {"a": {"b": []}}],  # instructions are text or JSON
}


def _right(key: str, tool: str, value: Any) -> bool:
    if key == "question" and tool == "ask_yes_no" and value is None:
        return False  # required there
    return any(type(value) is type(ok) and value == ok for ok in RIGHT.get(key, []))


def wrong_types(rng: random.Random) -> Call:
    tool, key = rng.choice([("decide", "state"), ("decide", "questions"), ("decide", "model"),
                            ("decide", "images"), ("decide", "videos"), ("ask_yes_no", "question"),
                            ("ask_yes_no", "criteria"), ("choose", "options"), ("rate", "levels"),
                            ("rate", "question"), ("ask_again", "state"), ("ask_again", "questions"),
                            ("choose", "images"), ("ask_yes_no", "model")])
    base: dict[str, dict[str, Any]] = {
        "decide": {"state": STATE, "questions": QUESTIONS},
        "ask_yes_no": {"state": STATE, "question": "Is it urgent?"},
        "choose": {"state": STATE, "options": {"a": None, "b": None}},
        "rate": {"state": STATE, "levels": ["low", "high"]},
        "ask_again": {"state": "0" * 64, "questions": QUESTIONS},
    }
    value = rng.choice([v for v in WRONG if not _right(key, tool, v)])
    return tool, {**base[tool], key: value}


def huge_strings(rng: random.Random) -> Call:
    size = rng.choice([1, 5, 10]) * MiB
    big = ("é🙂" * (size // 6)) if rng.random() < 0.3 else "x" * size
    variants: list[Call] = [
        ("decide", {"state": big, "questions": QUESTIONS}),
        ("decide", {"state": {"messages": [big[: size // 4]] * 4}, "questions": QUESTIONS}),
        ("ask_yes_no", {"state": STATE, "question": big}),
        ("choose", {"state": STATE, "options": {big: None, "b": None}}),
        ("choose", {"state": STATE, "options": {"a": big, "b": None}}),
        ("rate", {"state": STATE, "levels": ["low", big]}),
        ("decide", {"state": STATE, "questions": {big[: MiB]: {"type": "noul"}}}),
        ("decide", {"state": STATE, "questions": QUESTIONS, "model": big[: 2 * MiB]}),
        ("ask_yes_no", {"state": STATE, "question": "ok?", "criteria": {"true": big}}),
    ]
    return rng.choice(variants)


def bad_images(rng: random.Random) -> Call:
    name = rng.choice(["truncated", "garbage", "bomb", "aspect", "huge", "not-base64", "url", "path", "text-uri",
                       "svg-uri", "block-no-data", "block-number", "block-mime", "too-many", "nested", "number"])
    value: Any
    if name in ("truncated", "garbage", "bomb", "aspect", "huge"):
        value = [image(name)] if rng.random() < 0.5 else [{"type": "image", "data": image(name),
                                                           "mimeType": "image/png"}]
    else:
        value = {
            "not-base64": ["this is not base64!"],
            "url": ["https://example.com/cat.png"],
            "path": ["/etc/passwd.png"],
            "text-uri": ["data:text/plain;base64," + base64.b64encode(b"hello").decode()],
            "svg-uri": ["data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode()],
            "block-no-data": [{"type": "image", "mimeType": "image/png"}],
            "block-number": [{"type": "image", "data": 12, "mimeType": "image/png"}],
            "block-mime": [{"type": "image", "data": image("good"), "mimeType": ["image/png"]}],
            "too-many": [image("good")] * 17,
            "nested": [[image("good")]],
            "number": [42],
        }[name]
    return "ask_yes_no", {"model": "vision", "state": "a photo", "question": "Is it red?", "images": value}


def huge_counts(rng: random.Random) -> Call:
    deep: Any = "x"
    for _ in range(65):
        deep = [deep]
    variants: list[Call] = [
        ("decide", {"state": STATE, "questions": {f"q{i}": {"type": "noul"} for i in range(65)}}),
        ("choose", {"state": STATE, "options": {f"o{i}": None for i in range(256)}}),
        ("rate", {"state": STATE, "levels": [f"level {i}" for i in range(11)]}),
        ("decide", {"state": STATE, "questions": {f"q{i}": {"type": "choice", "criteria": {
            f"o{j}": None for j in range(255)}} for i in range(64)}}),
        ("decide", {"state": deep, "questions": QUESTIONS}),
        ("ask_yes_no", {"state": STATE, "question": "ok?", "images": ["x"] * 1000}),
    ]
    return rng.choice(variants)


def ask_again_abuse(rng: random.Random) -> Call:
    digest = "".join(rng.choice("0123456789abcdef") for _ in range(64))
    variants: list[Call] = [
        ("ask_again", {"state": digest, "questions": QUESTIONS}),
        ("ask_again", {"state": digest.upper(), "questions": QUESTIONS}),
        ("ask_again", {"state": digest[:63], "questions": QUESTIONS}),
        ("ask_again", {"state": "../" * 30, "questions": QUESTIONS}),
        ("ask_again", {"state": KNOWN.get("digest", digest), "questions": {"q": {"type": "score"}}}),
        ("ask_again", {"state": KNOWN.get("digest", digest), "questions": [1]}),
        ("ask_again", {"state": KNOWN.get("digest", digest), "questions": QUESTIONS, "model": "vision"}),
    ]
    return rng.choice(variants)


def unknown_tools(rng: random.Random) -> Call:
    return rng.choice(["", "Decide", "decide ", "rm -rf", "x" * 10_000, "ask_again\0", "tools/list"]), {}


def odd_unicode(rng: random.Random) -> Call:
    # no lone surrogates: the SDK's client cannot serialize them (its connection dies); tests/test_mcp.py sends
    # them as raw lines
    text = rng.choice(["\0\0\0", "\x1b[2J\x07", "\u202e\u2066RTL", "\ufeff" * 1000, "🙂" * 5000, "\U0010ffff",
                       "\u0301" * 3000, "\r\n" * 2000])
    return rng.choice([("decide", {"state": text, "questions": QUESTIONS}),
                       ("choose", {"state": STATE, "options": {text: None, "b": text}}),
                       ("ask_yes_no", {"state": STATE, "question": text})])


KINDS: dict[str, Callable[[random.Random], Call]] = {
    "malformed arguments": malformed, "wrong types": wrong_types, "huge strings": huge_strings,
    "bad images": bad_images, "huge counts": huge_counts, "ask_again abuse": ask_again_abuse,
    "unknown tools": unknown_tools, "odd unicode": odd_unicode,
}
KNOWN: dict[str, str] = {}  # a digest a good call returned


# ---------------------------------------------------------------- running

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_args(model: str, vision: str) -> list[str]:
    # bounded caches (the answered odd-Unicode states fill them), so that RSS says whether anything else grows
    return ["--model", f"clef-local={model}", "--model", f"vision={vision}", "--remember", "8MiB",
            "--state-cache", "32MiB"]


@asynccontextmanager
async def http_transport(url: str) -> AsyncIterator[Any]:
    """The SDK's streamable HTTP transport with the API key, its HTTP client closed with it."""
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    async with httpx2.AsyncClient(headers={"authorization": f"Bearer {KEY}"},
                                  timeout=httpx2.Timeout(60.0, read=600.0)) as client, \
            streamable_http_client(url, http_client=client) as streams:
        yield streams


def outcome(result: Any) -> str:
    if not result.is_error:
        return "answer"
    status = (result.structured_content or {}).get("status")
    return f"error {status}"


async def drive(args: argparse.Namespace, target: Any, pid: Callable[[], int]) -> dict[str, Any]:
    from mcp import Client
    from mcp.shared.exceptions import MCPError

    rng = random.Random(args.seed)
    kinds = list(KINDS)
    seen: dict[str, Counter[str]] = defaultdict(Counter)
    good_ms: list[float] = []
    good_failed = 0
    rss: list[int] = []
    peak = 0
    async with Client(target, read_timeout_seconds=600) as client:
        process = psutil.Process(pid())

        async def good(i: int) -> None:
            nonlocal good_failed
            began = time.perf_counter()
            if KNOWN and i % 2:
                result = await client.call_tool("ask_again", {"state": KNOWN["digest"], "questions": QUESTIONS})
            else:
                result = await client.call_tool("decide", GOOD[i % len(GOOD)])
            good_ms.append((time.perf_counter() - began) * 1000)
            if result.is_error:
                good_failed += 1
                print(f"a good call failed: {result.content[0].text}", file=sys.stderr)
            elif "digest" not in KNOWN:
                KNOWN["digest"] = str(result.meta["clef-local/state"])

        for i in range(3):
            await good(i)
        rss.append(process.memory_info().rss)
        from tqdm import tqdm

        for i in tqdm(range(args.calls), desc="hostile calls", unit="call", file=sys.stderr):
            kind = kinds[i % len(kinds)]
            tool, arguments = KINDS[kind](rng)
            try:
                seen[kind][outcome(await client.call_tool(tool, arguments))] += 1
            except MCPError as exc:
                seen[kind][f"protocol error {exc.code}"] += 1
            except Exception as exc:  # the client could not send it (what the SDK's own serializer refuses)
                seen[kind][f"client {type(exc).__name__}"] += 1
            if i % 10 == 0:
                peak = max(peak, process.memory_info().rss)
            if (i + 1) % args.every == 0:
                await good(i)
            if (i + 1) % max(1, args.calls // 4) == 0:
                rss.append(process.memory_info().rss)
        await good(args.calls)
        last_answered = not good_failed
        rss.append(process.memory_info().rss)
        peak = max([peak, *rss])
    totals: Counter[str] = Counter()
    for counts in seen.values():
        totals.update(counts)
    return {
        "calls": args.calls, "transport": args.transport, "kinds": {k: dict(v) for k, v in seen.items()},
        "server_5xx": sum(n for k, n in totals.items() if k.startswith("error 5")),
        "lost": sum(n for k, n in totals.items() if k.startswith("client") and "Timeout" in k),
        "rss_mib": [round(r / MiB, 1) for r in rss], "peak_mib": round(peak / MiB, 1),
        "good": len(good_ms), "good_failed": good_failed, "last_good_answered": last_answered,
        "good_p50_ms": round(statistics.median(good_ms), 1),
        "good_p99_ms": round(sorted(good_ms)[min(len(good_ms) - 1, int(0.99 * len(good_ms)))], 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from mcp import StdioServerParameters

    from clef_local.demo.default import default_model_path

    model = str(args.model or default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        vision = args.vision
        if vision is None:
            from clef_local.testing import build_tiny_release

            vision = str(build_tiny_release(Path(tmp) / "vision", backbone="qwen3_5", seed=0, vision=True))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "clef_local.cli", "mcp", *server_args(model, vision)]
        if args.transport == "stdio":
            target = StdioServerParameters(command=command[0], args=command[1:], env=env, cwd=str(ROOT))

            def pid() -> int:
                children = psutil.Process().children(recursive=True)
                return next(c.pid for c in children if "clef_local.cli" in " ".join(c.cmdline()))

            return asyncio.run(drive(args, target, pid))
        port = free_port()
        server = subprocess.Popen([*command, "--http", "--port", str(port), "--api-key", KEY], env=env, cwd=ROOT)
        try:
            url = f"http://127.0.0.1:{port}/mcp"
            deadline = time.monotonic() + 600
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the server did not start") from None
                    time.sleep(0.5)
            return asyncio.run(drive(args, http_transport(url), lambda: server.pid))
        finally:
            server.terminate()
            server.wait(60)


def render(summary: dict[str, Any]) -> str:
    lines = ["| kind | calls | outcomes |", "|---|---:|---|"]
    for kind, counts in summary["kinds"].items():
        shown = ", ".join(f"{k} × {n}" for k, n in sorted(counts.items()))
        lines.append(f"| {kind} | {sum(counts.values())} | {shown} |")
    lines.append(f"| good (between them) | {summary['good']} | answered × {summary['good'] - summary['good_failed']}"
                 f" |")
    rss = summary["rss_mib"]
    lines += ["", f"{summary['calls']} hostile calls over {summary['transport']}: {summary['server_5xx']} 5xx, "
                  f"{summary['lost']} lost; server RSS {rss[0]} MiB before, {', '.join(map(str, rss[1:-1]))} after "
                  f"each quarter, {rss[-1]} MiB at the end (peak {summary['peak_mib']} MiB); good calls p50 "
                  f"{summary['good_p50_ms']} ms, p99 {summary['good_p99_ms']} ms; the last one "
                  f"{'answered' if summary['last_good_answered'] else 'NOT answered'}"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="the release served as clef-local (default: the built-in default model)")
    parser.add_argument("--vision", help="a release with a vision tower served as vision (default: a tiny one)")
    parser.add_argument("--calls", type=int, default=1000, help="hostile calls (default 1000)")
    parser.add_argument("--every", type=int, default=25, help="a good call after every N hostile ones")
    parser.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args()
    summary = run(args)
    print(render(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    failed = summary["server_5xx"] or summary["lost"] or summary["good_failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
