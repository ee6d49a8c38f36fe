"""A soak check, not a benchmark: thousands of hostile requests mixed with good ones against ``clef-local serve``.

    python scripts/abuse_replay.py                               # the default model, 2,000 hostile requests
    python scripts/abuse_replay.py --model DIR --hostile 4000 --every 20 --threads 1

The real CLI server runs in its own process on a free loopback port (``--api-key``, so bad keys mean something;
default limits, timeouts and allocator settings: what a user runs). A seeded generator builds ``--hostile``
requests of the kinds below, round-robin; one good request (the built-in triage, moderation and routing examples)
goes after every ``--every`` hostile ones, and ``--baseline`` good requests run alone first for comparison. While the
replay runs, 50 slow clients (20 trickling headers, 20 trickling a body shorter than its ``Content-Length``, 10 idle)
hold connections until the server drops them. Everything goes to 127.0.0.1 only.

Kinds: oversized fields (10 MB instructions, descriptions, levels, states, ids, labels, model names), oversized and
lying bodies, decompression bombs (zstd, gzip, deflate, stacked), deep nesting, bad UTF-8, bad JSON (NaN, huge
numbers, lone surrogates, truncation), duplicate keys, wrong content types (text/plain, forms, multipart, images,
none, a Latin-1 charset), foreign ``Host`` and ``Origin``, bad auth, garbage encodings, huge option and question
counts, schema errors, wrong routes and methods, raw HTTP garbage (bad request lines, oversized or duplicated
headers).

Prints, per kind, the requests sent and the statuses seen; the number of 5xx answers (must be 0) and of
connections the client lost; server RSS before and after (and its peak); p50 / p99 latency of the good requests
alone and during the replay; what became of the slow clients. The last run's table:
docs/benchmarks.md#hardening-the-abuse-replay.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

from clef_local.demo.default import default_model_path

try:
    from compression import zstd  # type: ignore[import-not-found]  # Python 3.14+
except ImportError:
    from backports import zstd

KEY = "abuse-replay-key"
AUTH = {"authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json"}
BIG = 10_000_000  # characters in an oversized field
EXAMPLES = ("triage", "moderation", "routing")
SLOW = {"headers": 20, "body": 20, "idle": 10}


def examples() -> list[dict[str, Any]]:
    files = resources.files("clef_local.demo.examples")
    return [{**json.loads(files.joinpath(f"{name}.json").read_text()), "model": "clef-local"} for name in EXAMPLES]


GOOD = examples()
VALID = GOOD[0]
VALID_BYTES = json.dumps(VALID).encode()


@dataclass
class Case:
    """One hostile request: over HTTP (``method``, ``path``, ``headers``, ``body``) or as ``raw`` socket bytes."""

    kind: str
    method: str = "POST"
    path: str = "/v1/systemone"
    headers: dict[str, str] = field(default_factory=lambda: {**AUTH, **JSON})
    body: bytes | Callable[[], Iterator[bytes]] | None = None
    raw: bytes | None = None


# ---------------------------------------------------------------- the generator

_cache: dict[str, bytes] = {}


def cached(name: str, make: Callable[[], bytes]) -> bytes:
    """Large bodies are built once and sent many times."""
    if name not in _cache:
        _cache[name] = make()
    return _cache[name]


def with_question(question: dict[str, Any], qid: str = "q") -> dict[str, Any]:
    return {**VALID, "questions": {qid: question}}


def oversized_field(rng: random.Random) -> Case:
    big = "é🙂" * (BIG // 6) if rng.random() < 0.3 else "x" * BIG
    variants: dict[str, Callable[[], dict[str, Any]]] = {
        "instructions": lambda: with_question({"type": "noul", "instructions": big}),
        "structured-instructions": lambda: with_question({"type": "noul",
                                                          "instructions": {"a": [big[: BIG // 2]] * 2}}),
        "description": lambda: with_question({"type": "choice", "criteria": {"a": big, "b": None}}),
        "noul-criteria": lambda: with_question({"type": "noul", "criteria": {"true": big}}),
        "level": lambda: with_question({"type": "score", "criteria": ["low", big]}),
        "state": lambda: {**VALID, "state": big},
        "state-object": lambda: {**VALID, "state": {"messages": [big[: BIG // 4]] * 4}},
        "question-id": lambda: with_question({"type": "noul"}, qid=big),
        "label": lambda: with_question({"type": "choice", "criteria": {"a": None, big: None}}),
        "model": lambda: {**VALID, "model": big},
    }
    name = rng.choice(sorted(variants))
    ascii_only = big.isascii()
    return Case("oversized field", body=cached(f"field-{name}-{ascii_only}",
                                               lambda: json.dumps(variants[name](), ensure_ascii=False).encode()))


def oversized_body(rng: random.Random) -> Case:
    how = rng.choice(["14 MiB", "chunked", "lying-length", "huge-length"])
    if how == "14 MiB":
        return Case("oversized body", body=cached("14MiB", lambda: b"{" + b" " * (14 << 20) + b"}"))
    if how == "chunked":
        return Case("oversized body", body=lambda: (b" " * (1 << 20) for _ in range(15)))
    length = 999_999_999 if how == "huge-length" else 20 << 20
    raw = (f"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\nContent-Type: "
           f"application/json\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n").encode() + b"{" * 1000
    return Case("oversized body", raw=raw)


def bomb(rng: random.Random) -> Case:
    how = rng.choice(["zstd", "gzip", "deflate", "zstd-json", "zstd,zstd", "gzip-json"])
    if how == "zstd":
        body = cached("zstd", lambda: zstd.compress(b"\0" * (100 << 20)))
    elif how == "gzip":
        body = cached("gzip", lambda: gzip.compress(b"\0" * (50 << 20), compresslevel=9))
    elif how == "deflate":
        body = cached("deflate", lambda: zlib.compress(b" " * (50 << 20), 9))
    elif how == "zstd-json":
        body = cached("zstd-json", lambda: zstd.compress(json.dumps({**VALID, "state": "a" * (20 << 20)}).encode()))
    elif how == "zstd,zstd":
        body = cached("zstd2", lambda: zstd.compress(zstd.compress(b"\0" * (200 << 20))))
    else:
        body = cached("gzip-json", lambda: gzip.compress(json.dumps({**VALID, "state": "b" * (20 << 20)}).encode()))
    encoding = {"zstd-json": "zstd", "gzip-json": "gzip"}.get(how, how)
    return Case("decompression bomb", headers={**AUTH, **JSON, "content-encoding": encoding}, body=body)


def deep(rng: random.Random) -> Case:
    depth = rng.choice([65, 100, 1000, 10_000, 100_000])
    opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
    nested = opener * depth + b"1" + closer * depth
    where = rng.choice(["state", "instructions", "criteria"])
    if where == "state":
        body = b'{"model": "clef-local", "questions": {"q": {"type": "noul"}}, "state": ' + nested + b"}"
    elif where == "instructions":
        body = b'{"model": "clef-local", "state": "x", "questions": {"q": {"type": "noul", "instructions": ' \
               + nested + b"}}}"
    else:
        body = b'{"model": "clef-local", "state": "x", "questions": {"q": {"type": "score", "criteria": ' \
               + nested + b"}}}"
    return Case("deep nesting", body=body)


def bad_utf8(rng: random.Random) -> Case:
    cut = rng.randrange(len(VALID_BYTES))
    junk = rng.choice([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf", b"\xe2\x82"])
    return Case("bad UTF-8", body=VALID_BYTES[:cut] + junk + VALID_BYTES[cut:])


def bad_json(rng: random.Random) -> Case:
    value = rng.choice([b"NaN", b"-Infinity", b"1e999", b"9" * 5000, b'"\\ud800"', b'"\\udfff"', b"tru", b"'x'",
                        b'"\\u00"', b"[1,]", b"{", b""])
    template = rng.choice([b'{"model": "clef-local", "state": %s, "questions": {"q": {"type": "noul"}}}',
                           b'{"model": "clef-local", "state": "x", "questions": {"q": {"type": "noul", '
                           b'"instructions": %s}}}', b"%s"])
    body = template.replace(b"%s", value)
    if rng.random() < 0.2:
        body = VALID_BYTES[: rng.randrange(len(VALID_BYTES))]
    return Case("bad JSON", body=body)


def duplicate_keys(rng: random.Random) -> Case:
    body = rng.choice([
        VALID_BYTES[:-1] + b', "model": "jev-latest"}',
        VALID_BYTES[:-1] + b', "questions": {"q": {"type": "noul"}}}',
        b'{"model": "clef-local", "state": "x", "questions": {"q": {"type": "noul"}, "q": {"type": "score"}}}',
        b'{"model": "clef-local", "state": {"a": {"b": [{"c": 1, "c": 2}]}}, "questions": {"q": {"type": "noul"}}}',
        b'{"model": "clef-local", "state": "x", "questions": {"q": {"type": "choice", "criteria": '
        b'{"a": null, "b": null, "a": "again"}}}}',
    ])
    return Case("duplicate keys", body=body)


def content_type(rng: random.Random) -> Case:
    kind = rng.choice(["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "image/png",
                       "multipart/form-data; boundary=zz", "", "application/json; charset=latin-1",
                       "application/javascript", "application/jsonp"])
    headers = {**AUTH, **({"content-type": kind} if kind else {})}
    return Case("wrong content type", headers=headers, body=VALID_BYTES)


def foreign_host(rng: random.Random) -> Case:
    if rng.random() < 0.5:
        host = rng.choice(["evil.example", "evil.example:8077", "127.0.0.1.nip.io", "localhost.evil.example",
                           "[::2]", "0.0.0.0", "10.0.0.1"])
        return Case("foreign Host", headers={**AUTH, **JSON, "host": host}, body=VALID_BYTES)
    origin = rng.choice(["http://evil.example", "null", "http://localhost:3000", "https://127.0.0.1"])
    return Case("foreign Origin", headers={**AUTH, **JSON, "origin": origin}, body=VALID_BYTES)


def bad_auth(rng: random.Random) -> Case:
    header = rng.choice([None, "Bearer wrong", f"Bearer {KEY}x", f"Basic {KEY}", KEY, "Bearer " + "k" * 4000,
                         f"bearer  {KEY[:-1]}"])
    headers = {**JSON, **({"authorization": header} if header else {})}
    path = rng.choice(["/v1/systemone", "/v1/models", "/metrics"])
    return Case("bad auth", method="POST" if path == "/v1/systemone" else "GET", path=path, headers=headers,
                body=VALID_BYTES if path == "/v1/systemone" else None)


def garbage_encoding(rng: random.Random) -> Case:
    encoding, body = rng.choice([
        ("br", VALID_BYTES), ("x" * 60, VALID_BYTES), ("zstd, br", VALID_BYTES), ("compress", VALID_BYTES),
        ("zstd", b"\x28\xb5\x2f\xfd" + bytes(rng.randrange(256) for _ in range(40))),
        ("zstd", zstd.compress(VALID_BYTES)[:-4]), ("gzip", b"\x1f\x8b\x08" + b"\0" * 30),
        ("deflate", b"not deflate"), ("gzip", gzip.compress(VALID_BYTES) + b"trailing"),
    ])
    return Case("garbage encoding", headers={**AUTH, **JSON, "content-encoding": encoding}, body=body)


def huge_counts(rng: random.Random) -> Case:
    how = rng.choice(["256 options", "64x255 options", "65 questions", "11 levels", "1000 questions"])
    if how == "256 options":
        request = with_question({"type": "choice", "criteria": {f"o{i}": None for i in range(256)}})
    elif how == "64x255 options":
        request = {**VALID, "questions": {f"q{i}": {"type": "choice", "criteria": {f"option {j}": f"d{j}"
                                                                                   for j in range(255)}}
                                          for i in range(64)}}
    elif how == "11 levels":
        request = with_question({"type": "score", "criteria": [f"l{i}" for i in range(11)]})
    else:
        n = 65 if how == "65 questions" else 1000
        request = {**VALID, "questions": {f"q{i}": {"type": "noul"} for i in range(n)}}
    return Case("huge counts", body=cached(how, lambda: json.dumps(request).encode()))


def schema_error(rng: random.Random) -> Case:
    request = rng.choice([
        {"model": "clef-local", "state": "x"}, {"state": "x", "questions": {"q": {"type": "noul"}}},
        {**VALID, "model": "gpt-4"}, {**VALID, "model": 7}, {**VALID, "state": 12}, {**VALID, "questions": []},
        with_question({"type": "boolean"}), with_question({"type": "score", "criteria": {"0": "low", "1": "hi"}}),
        with_question({"type": "choice", "criteria": {"only": None}}), with_question({"type": "noul", "criteria": 1}),
        with_question({"type": "noul", "criteria": {"maybe": "x"}}), {**VALID, "images": ["data:image/png;base64,"]},
        with_question({"type": "noul"}, qid=""), [VALID], "just a string",
    ])
    return Case("schema error", body=json.dumps(request).encode())


def wrong_route(rng: random.Random) -> Case:
    method, path = rng.choice([("GET", "/v1/systemone"), ("PUT", "/v1/systemone"), ("DELETE", "/v1/models"),
                               ("POST", "/v2/systemone"), ("POST", "/v1/systemone/"), ("GET", "/../../etc/passwd"),
                               ("POST", "/accounts/a/ai/run/@cf/cloudflare/nope"), ("GET", "/%00"),
                               ("POST", "/accounts/" + "a" * 5000 + "/ai/run/@cf/cloudflare/clef-local")])
    return Case("wrong route", method=method, path=path, body=VALID_BYTES if method in ("POST", "PUT") else None)


def raw_http(rng: random.Random) -> Case:
    raw = rng.choice([
        b"GARBAGE\r\n\r\n", b"POST /v1/systemone HTTP/9.9\r\nHost: 127.0.0.1\r\n\r\n",
        b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n",
        b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\nContent-Length: 9\r\n\r\n{}",
        b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n\r\n",
        b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\0" * 64,  # a TLS ClientHello
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
    ])
    return Case("raw HTTP garbage", raw=raw)


GENERATORS: list[Callable[[random.Random], Case]] = [
    oversized_field, oversized_body, bomb, deep, bad_utf8, bad_json, duplicate_keys, content_type, foreign_host,
    bad_auth, garbage_encoding, huge_counts, schema_error, wrong_route, raw_http]


def generate(count: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    return [GENERATORS[i % len(GENERATORS)](rng) for i in range(count)]


# ---------------------------------------------------------------- sending


def send_raw(port: int, raw: bytes) -> str:
    """The status of a raw request's answer; ``hung up`` when the server closed without one (the request was sent
    whole, then the client's side shut: a body shorter than its ``Content-Length`` is a client that went away)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            head = sock.recv(64)
        except OSError:
            return "hung up"
    return head.split(b" ")[1].decode() if head.startswith(b"HTTP/1.1 ") else "hung up"


def send(http: httpx.Client, port: int, case: Case) -> str:
    if case.raw is not None:
        return send_raw(port, case.raw)
    body = case.body() if callable(case.body) else case.body
    try:
        return str(http.request(case.method, case.path, headers=case.headers, content=body).status_code)
    except httpx.TransportError as exc:
        return f"lost ({type(exc).__name__})"


def slow_clients(port: int, report: dict[str, list[float]], stop: threading.Event) -> None:
    """Hold :data:`SLOW` connections, trickling a byte a second, until the server drops them (or ``stop``)."""
    conns: list[tuple[str, socket.socket, float]] = []
    for kind, count in SLOW.items():
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            if kind == "headers":
                sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            elif kind == "body":
                sock.sendall(f"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                             "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{".encode())
            sock.setblocking(False)
            conns.append((kind, sock, time.monotonic()))
    while conns and not stop.is_set():
        for entry in list(conns):
            kind, sock, opened = entry
            try:
                if kind != "idle":
                    sock.send(b"a" if kind == "headers" else b" ")
                while sock.recv(65536):
                    pass
                raise ConnectionResetError  # EOF
            except BlockingIOError:
                continue
            except OSError:
                report[kind].append(time.monotonic() - opened)
                sock.close()
                conns.remove(entry)
        stop.wait(1.0)
    for kind, sock, _ in conns:
        report.setdefault(f"{kind} (still open)", []).append(0.0)
        sock.close()


# ---------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int, field_name: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no {field_name} for {pid}")


def start_server(model: Path, log: Path, threads: int | None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = [sys.executable, "-m", "clef_local.cli", "serve", "--model", f"clef-local={model}", "--port", str(port),
               "--api-key", KEY, "--max-queue", "256"]
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process, port
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("the server did not start in 300 s")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="release directory (default: the default model)")
    parser.add_argument("--hostile", type=int, default=2000, help="hostile requests (default 2000)")
    parser.add_argument("--every", type=int, default=25, help="one good request after this many hostile (25)")
    parser.add_argument("--baseline", type=int, default=10, help="good requests alone, first (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the server (OMP_NUM_THREADS)")
    args = parser.parse_args(argv)
    model = args.model or default_model_path()
    cases = generate(args.hostile, args.seed)
    statuses: dict[str, Counter[str]] = defaultdict(Counter)
    good_alone: list[float] = []
    good_during: list[float] = []
    slow: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        process, port = start_server(model, log, args.threads)
        url = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(base_url=url, timeout=120) as http:  # no default headers: each case sends its own
                for i in range(args.baseline):
                    started = time.perf_counter()
                    assert http.post("/v1/systemone", json=GOOD[i % len(GOOD)], headers=AUTH).status_code == 200
                    good_alone.append(time.perf_counter() - started)
                rss_before = rss_mib(process.pid)
                Path(f"/proc/{process.pid}/clear_refs").write_text("5")  # reset the peak (VmHWM)
                stop = threading.Event()
                slow_thread = threading.Thread(target=slow_clients, args=(port, slow, stop), daemon=True)
                slow_thread.start()
                began = time.perf_counter()
                rss_along = []
                for i, case in enumerate(cases):
                    statuses[case.kind][send(http, port, case)] += 1
                    if (i + 1) % max(1, len(cases) // 4) == 0:
                        rss_along.append(rss_mib(process.pid))
                    if (i + 1) % args.every == 0:
                        started = time.perf_counter()
                        response = http.post("/v1/systemone", json=GOOD[(i // args.every) % len(GOOD)],
                                             headers=AUTH)
                        good_during.append(time.perf_counter() - started)
                        statuses["good"][str(response.status_code)] += 1
                elapsed = time.perf_counter() - began
                slow_thread.join(60)
                stop.set()
                assert http.post("/v1/systemone", json=VALID, headers=AUTH).status_code == 200
                rss_after, rss_peak = rss_mib(process.pid), rss_mib(process.pid, "VmHWM")
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
        text = log.read_text(errors="replace")
        tracebacks = text.count("Traceback")
        if tracebacks:
            start = text.index("Traceback")
            print(text[max(0, start - 300): start + 8000], file=sys.stderr)

    hostile = sum(sum(c.values()) for kind, c in statuses.items() if kind != "good")
    five = sum(n for c in statuses.values() for s, n in c.items() if s.isdigit() and int(s) >= 500)
    lost = sum(n for c in statuses.values() for s, n in c.items() if s.startswith("lost"))
    print(f"model {model}; {os.cpu_count()} CPUs; torch threads {args.threads}; seed {args.seed}; "
          f"{hostile} hostile + {len(good_during)} good requests in {elapsed:.0f} s\n")
    print("| kind | requests | statuses |\n|---|---:|---|")
    for kind in [*sorted(k for k in statuses if k != "good"), "good"]:
        counts = statuses[kind]
        shown = ", ".join(f"{s} × {n}" for s, n in sorted(counts.items()))
        print(f"| {kind} | {sum(counts.values()):,} | {shown} |")
    for kind in SLOW:
        held = slow.get(kind, [])
        still = len(slow.get(f"{kind} (still open)", []))
        span = f"held {min(held):.1f}–{max(held):.1f} s" if held else "none closed"
        print(f"| slow client ({kind}) | {SLOW[kind]} | dropped by the server × {len(held)} ({span}); "
              f"still open × {still} |")
    print(f"\n5xx answers: {five}; connections lost by the client: {lost}; tracebacks in the server log: "
          f"{tracebacks}")
    print(f"server RSS: {rss_before:.0f} MiB before the replay; after each quarter "
          f"{', '.join(f'{r:.0f}' for r in rss_along)} MiB; {rss_after:.0f} MiB at the end; peak {rss_peak:.0f} MiB")
    for name, values in (("alone", good_alone), ("during the replay", good_during)):
        print(f"good requests {name}: n={len(values)}, p50 {1e3 * statistics.median(values):.0f} ms, "
              f"p99 {1e3 * percentile(values, 0.99):.0f} ms")
    return 1 if five or tracebacks else 0


if __name__ == "__main__":
    sys.exit(main())
