"""``clef-local serve`` under load and abuse (loopback only, bounded in count and time).

- 8 concurrent clients × 50 requests of mixed shapes: all 200, each answer equal to a direct ``decide``.
- ≥ 2,000 generated malformed or hostile requests (hypothesis) against the real CLI server in a subprocess,
  then the same again twice: never a 5xx, the server still answers afterwards, its RSS grows by less than
  :data:`RSS_SETTLE_BOUND` over the first pass and the last replay ends less than :data:`RSS_GROWTH_BOUND` above
  every level held before it, and SIGTERM stops it cleanly.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from request_gen import varied_requests

import clef_local
from clef_local.errors import MaxTokensExceededError
from clef_local.runtime.answers import round_floats
from clef_local.server import ServerConfig, ThreadedServer, create_app

try:
    from compression import zstd  # type: ignore[import-not-found]  # Python 3.14+
except ImportError:
    from backports import zstd

CLIENTS = 8
PER_CLIENT = 50
HOSTILE_EXAMPLES = 2000
RSS_SETTLE_BOUND = 128 * 1024 * 1024  # bytes of RSS growth over the first 2,000 (allocator arenas settling)
RSS_GROWTH_BOUND = 16 * 1024 * 1024  # bytes of RSS growth during the second replay of the same 2,000
VALID: dict[str, Any] = {
    "model": "clef-local",
    "state": "Please refund the double charge.",
    "questions": {"refund": {"type": "noul"},
                  "team": {"type": "choice", "criteria": {"billing": None, "tech": "Bugs"}},
                  "anger": {"type": "score", "criteria": ["calm", "angry"]}},
}


def assert_close(got: Any, want: Any, where: str = "") -> None:
    """Equal JSON, floats within one unit of the 4th decimal (rounding of values that differ by float noise)."""
    if isinstance(want, float) or isinstance(got, float):
        assert abs(got - want) <= 1.01e-4, f"{where}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_close(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> Iterator[Any]:
    """The tiny Llama, with torch on one intra-op thread while this module runs: on a 2-core machine the 8 client
    threads, the event loop and the inference thread already fill the cores, and OpenMP threads fighting them
    for CPU make a 5 ms forward take 300 ms."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield clef_local.load(tiny_llama, dtype="float32")
    finally:
        torch.set_num_threads(threads)


def test_concurrent_clients_get_unbatched_answers(model: Any) -> None:
    pool = varied_requests(40, seed=7)  # 1 to 64 questions, up to 255 options, unicode, JSON states
    # the direct answers, computed before the server exists (one model, one thread at a time)
    expected = []
    for i, request in enumerate(pool):
        request["model"] = "clef-local"
        try:
            answer = model.decide(request)
        except MaxTokensExceededError:  # 64 questions overflow the tiny Llama's 8K context: keep 40
            request["questions"] = dict(list(request["questions"].items())[:40])
            answer = model.decide(request)
        expected.append(round_floats(answer, 4))
        request["model"] = "jev-latest" if i % 3 == 0 else "clef-local"
    app = create_app({"clef-local": model}, ServerConfig(max_batch=8, max_wait_ms=5))
    metrics = app.state.clef.metrics
    failures: list[str] = []
    exact = [0]
    lock = threading.Lock()

    def client(seed: int) -> None:
        order = random.Random(seed).choices(range(len(pool)), k=PER_CLIENT)
        with httpx.Client(base_url=running.url, timeout=120) as http:
            for i in order:
                response = http.post("/v1/systemone", json=pool[i])
                try:
                    assert response.status_code == 200, response.text[:200]
                    assert_close(response.json(), expected[i], f"request {i}")
                    with lock:
                        exact[0] += response.json() == expected[i]
                except AssertionError as exc:
                    with lock:
                        failures.append(str(exc))

    started = time.perf_counter()
    with ThreadedServer(app) as running:
        threads = [threading.Thread(target=client, args=(seed,)) for seed in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    elapsed = time.perf_counter() - started
    total = CLIENTS * PER_CLIENT
    batches = int(metrics.sample("clef_batch_size_count"))
    print(f"\n{total} requests from {CLIENTS} clients in {elapsed:.1f} s; {batches} batches "
          f"(mean {total / max(batches, 1):.2f} requests); {exact[0]} of {total} answers byte-identical "
          "to direct decide, the rest within 1e-4")
    assert not failures, failures[:5]
    assert metrics.sample("clef_requests_total", route="/v1/systemone", status="200") == total
    assert batches < total  # concurrent requests were batched


# ---------------------------------------------------------------- hostile input against the CLI server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def cli_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen]]:
    """``clef-local serve`` in a subprocess on a free loopback port, stopped with SIGTERM.

    uvicorn shuts down gracefully on SIGTERM and then re-raises the signal, so the exit status is -SIGTERM (or 0);
    the log must show the lifespan shutdown completing and no traceback.
    """
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # a state cache of a fixed, small size: the hostile states fill it and churn it, and its bytes count in the
    # first pass's settling (RSS_SETTLE_BOUND), never in a replay's growth
    command = [sys.executable, "-m", "clef_local.cli", "serve", "--model", f"clef-local={tiny_llama}",
               "--port", str(port), "--dtype", "float32", "--max-queue", "256", "--state-cache", "16MiB"]
    # OMP: see `model`, the client shares the two cores. glibc's allocator otherwise makes RSS noise that is not a
    # leak: an arena per new thread (large bodies are decoded off the event loop), and a mmap threshold that rises
    # after the first multi-MiB bodies are freed, so later ones land in the heap and stay (+56 MiB seen in a replay).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "1048576"}
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)
    try:
        yield url, process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        text = log.read_text(errors="replace")
        assert code in (0, -signal.SIGTERM), text[-3000:]
        assert "Application shutdown complete" in text, text[-3000:]
        assert "Traceback" not in text, text[-3000:]  # no internal error was logged, ever


leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                 st.text(max_size=20))
json_any = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                        max_leaves=12)
options = st.sampled_from([0, 1, 2, 254, 255, 256, 300]).map(lambda n: {f"o{i}": None for i in range(n)})
levels = st.sampled_from([0, 1, 2, 10, 11, 30]).map(lambda n: [f"level {i}" for i in range(n)])
question = st.one_of(json_any, st.fixed_dictionaries({}, optional={
    "type": st.one_of(st.sampled_from(["noul", "choice", "score", "boolean", "NOUL", ""]), json_any),
    "instructions": json_any, "criteria": st.one_of(json_any, options, levels)}))
request = st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.sampled_from(["clef-local", "jev-latest", "nope", ""]), json_any),
    "state": st.one_of(st.text(max_size=100), json_any),
    "questions": st.one_of(json_any, st.dictionaries(st.text(max_size=8), question, max_size=4),
                           st.integers(0, 70).map(lambda n: {f"q{i}": {"type": "noul"} for i in range(n)})),
    "images": json_any, "x_extra": json_any})
VALID_BYTES = json.dumps(VALID).encode()
JSON = {"content-type": "application/json"}
ENCODINGS = ["zstd", "gzip", "deflate", "br", "identity", "zstd, gzip", "", "x" * 60, "zstd,zstd"]


@st.composite
def hostile(draw: st.DrawFn) -> tuple[str, str, bytes, dict[str, str]]:
    """(kind, path, body, headers) of one malformed or hostile request."""
    kind = draw(st.sampled_from(["request", "json", "bytes", "bad-utf8", "truncated", "zstd", "deep", "escapes",
                                 "large", "headers", "path", "valid-mutant", "duplicate-keys", "host"]))
    path, headers = "/v1/systemone", {"content-type": "application/json"}
    if kind == "request":
        body = json.dumps(draw(request), ensure_ascii=draw(st.booleans())).encode()
    elif kind == "json":
        body = json.dumps(draw(json_any)).encode()
    elif kind == "bytes":
        body = draw(st.binary(max_size=300))
    elif kind == "bad-utf8":
        cut = draw(st.integers(0, len(VALID_BYTES)))
        body = VALID_BYTES[:cut] + draw(st.sampled_from([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\xf8\x88\x80"])) \
            + VALID_BYTES[cut:]
    elif kind == "truncated":
        body = VALID_BYTES[: draw(st.integers(0, len(VALID_BYTES) - 1))]
    elif kind == "zstd":
        frame = bytearray(zstd.compress(draw(st.sampled_from([VALID_BYTES, b"[]", b"\0" * 1000]))))
        how = draw(st.sampled_from(["flip", "cut", "random", "double"]))
        if how == "flip":
            frame[draw(st.integers(0, len(frame) - 1))] ^= draw(st.integers(1, 255))
        elif how == "cut":
            frame = frame[: draw(st.integers(0, len(frame) - 1))]
        elif how == "random":
            frame = bytearray(b"\x28\xb5\x2f\xfd" + draw(st.binary(max_size=64)))
        else:
            frame = frame + frame
        body, headers["content-encoding"] = bytes(frame), "zstd"
    elif kind == "deep":
        depth = draw(st.integers(64, 5000))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        state = opener * depth + b"1" + closer * depth
        body = b'{"model": "clef-local", "questions": {"q": {"type": "noul"}}, "state": ' + state + b"}"
    elif kind == "escapes":
        value = draw(st.sampled_from([b'"\\ud800"', b'"\\udfff x"', b"NaN", b"-Infinity", b"1e999", b"9" * 4400,
                                      b'"\\u0000"', b'"\\ud83d\\ude00"', b"-0", b'"\\ud83d"']))
        body = b'{"model": "clef-local", "questions": {"q": {"type": "noul", "instructions": ' + value \
            + b'}}, "state": ' + value + b"}"
    elif kind == "large":
        size = draw(st.sampled_from([10_000, 100_000, 400_000]))
        body = json.dumps({**VALID, "state": draw(st.sampled_from(["a", "word ", "é🙂"])) * size}).encode()
    elif kind == "headers":
        body = draw(st.sampled_from([VALID_BYTES, zstd.compress(VALID_BYTES), b"{}"]))
        headers["content-encoding"] = draw(st.sampled_from(ENCODINGS))
        headers["content-type"] = draw(st.sampled_from(["application/json", "text/plain", "multipart/form-data",
                                                        "application/x-www-form-urlencoded", ""]))
        headers["authorization"] = draw(st.sampled_from(["Bearer x", "", "Basic abc", "Bearer " + "k" * 500]))
    elif kind == "duplicate-keys":
        key = draw(st.sampled_from([b'"model"', b'"state"', b'"questions"', b'"q"', b'"type"']))
        body = VALID_BYTES[:-1] + b", " + key + b": " + json.dumps(draw(json_any)).encode() + b"}"
        if key in (b'"q"', b'"type"'):
            body = (b'{"model": "clef-local", "state": "x", "questions": {"q": {"type": "noul", ' + key + b': 1}, '
                    + key + b": {}}}")
    elif kind == "host":
        body = VALID_BYTES
        headers["host"] = draw(st.sampled_from(["evil.example", "127.0.0.1.nip.io:80", "[::2]", "localhost:x"]))
        if draw(st.booleans()):
            headers["origin"] = draw(st.sampled_from(["http://evil.example", "null", "http://localhost:1"]))
    elif kind == "path":
        name = draw(st.text(alphabet="abc-._~%20é/", max_size=30))
        prefix = draw(st.sampled_from(["/accounts/a/ai/run/@cf/cloudflare/", "/v1/", "/v1/systemone/", "/x/"]))
        path = prefix + quote(name, safe=draw(st.sampled_from(["", "/", "-._~"])))
        body = VALID_BYTES
    else:  # a valid request with one field swapped for a random JSON value
        mutant = json.loads(VALID_BYTES)
        target = draw(st.sampled_from(["model", "state", "questions", "refund", "team", "anger", "criteria"]))
        value = draw(json_any)
        if target in ("model", "state", "questions"):
            mutant[target] = value
        elif target == "criteria":
            mutant["questions"]["team"]["criteria"] = value
        else:
            mutant["questions"][target] = value
        body = json.dumps(mutant).encode()
    return kind, path, body, headers


def _check(kind: str, response: httpx.Response) -> None:
    """No 5xx ever; garbage is always refused; every refusal has one of the documented error shapes."""
    assert response.status_code < 500, f"{kind}: {response.status_code} {response.text[:300]}"
    if kind in ("bytes", "bad-utf8", "truncated", "deep", "duplicate-keys", "host"):
        assert 400 <= response.status_code < 500, f"{kind} answered {response.status_code}"
    if response.status_code != 200:
        body = response.json()
        if "detail" in body:
            assert isinstance(body["detail"], list) or {"error_type", "message"} <= set(body["detail"])
        else:  # the Cloudflare route's envelope
            assert body["success"] is False and body["errors"][0]["code"] == response.status_code


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for RSS")
def test_hostile_requests_never_5xx(cli_server: tuple[str, subprocess.Popen]) -> None:
    """2,000 generated requests, then the same 2,000 replayed twice: RSS may settle during the first pass and the
    first replay (malloc arenas grow for the first multi-megabyte states; seen: +18 MiB in a replay) but must stay
    flat during the second replay, where anything kept per request would grow it again by as much."""
    url, process = cli_server
    statuses: dict[str, dict[int, int]] = {}
    cases: list[tuple[str, str, bytes, dict[str, str]]] = []
    with httpx.Client(base_url=url, timeout=120) as http:
        # the largest inputs first, so that the allocator has grown before the first baseline
        largest = [b"x" * (13 * 1024 * 1024 + 1), zstd.compress(b"\0" * (20 << 20))]
        largest += [json.dumps({**VALID, "state": text}).encode() for text in
                    ("word " * 400_000, "a" * 400_000, "é🙂" * 100_000, "é🙂" * 400_000)]
        for body in largest * 2:
            encoding = {"content-encoding": "zstd"} if body[:4] == b"\x28\xb5\x2f\xfd" else {}
            assert http.post("/v1/systemone", content=body, headers={**JSON, **encoding}).status_code == 413
        assert http.post("/v1/systemone", json=VALID).status_code == 200
        rss_start = _rss(process.pid)
        started = time.perf_counter()

        @settings(max_examples=HOSTILE_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(hostile())
        def one(case: tuple[str, str, bytes, dict[str, str]]) -> None:
            kind, path, body, headers = case
            response = http.post(path, content=body, headers=headers)
            cases.append(case)
            by_kind = statuses.setdefault(kind, {})
            by_kind[response.status_code] = by_kind.get(response.status_code, 0) + 1
            _check(kind, response)

        one()
        elapsed = time.perf_counter() - started
        rss_first = _rss(process.pid)
        rss_replays = []
        for _ in range(2):  # growth that a leak causes recurs on every replay; allocator settling does not
            for kind, path, body, headers in cases:
                _check(kind, http.post(path, content=body, headers=headers))
            assert http.get("/health").json()["status"] == "ok"
            assert http.post("/v1/systemone", json=VALID).status_code == 200
            rss_replays.append(_rss(process.pid))
        rss_replay = rss_replays[-1]
    sent = sum(len(body) for _, _, body, _ in cases)
    print(f"\n{len(cases)} hostile requests ({sent / 2**20:.1f} MiB of bodies) in {elapsed:.1f} s, then replayed; "
          f"statuses by kind: {statuses}; server RSS {rss_start / 2**20:.0f} -> {rss_first / 2**20:.0f} "
          f"-> {' -> '.join(f'{r / 2**20:.0f}' for r in rss_replays)} MiB")
    assert len(cases) >= HOSTILE_EXAMPLES
    assert rss_first - rss_start < RSS_SETTLE_BOUND, f"first pass: RSS grew by {(rss_first - rss_start) >> 20} MiB"
    # A leak raises the peak on every pass; a working set that returns to a level the server already held is the
    # allocator (CI, 2026-12-01: 848 at the start -> 694 -> 694 -> 812 MiB with no request leaking anything).
    growth = rss_replay - max(rss_start, rss_first, *rss_replays[:-1])
    assert growth < RSS_GROWTH_BOUND, f"second replay: RSS rose {growth >> 20} MiB above every earlier level"
    assert process.poll() is None


def test_oversize_and_lying_content_length(cli_server: tuple[str, subprocess.Popen]) -> None:
    url, _ = cli_server
    with httpx.Client(base_url=url, timeout=60, headers=JSON) as http:
        big = http.post("/v1/systemone", content=b"{" + b" " * (14 << 20) + b"}")
        assert big.status_code == 413
        # a chunked body (no Content-Length) over the limit
        chunks = (b" " * (1 << 20) for _ in range(15))
        assert http.post("/v1/systemone", content=chunks).status_code == 413
        assert http.get("/health").status_code == 200
    # a Content-Length far over the limit is refused before the body is read
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as raw:
        raw.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 999999999\r\n\r\n{")
        reply = raw.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert cli_server[1].poll() is None


def _peak_rss_reset(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM, the peak RSS (Linux ≥ 4.0)


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for RSS")
def test_oversized_fields_cost_nothing(cli_server: tuple[str, subprocess.Popen]) -> None:
    """A 10 MB instructions string is 413 in under a second without growing the server (it used to be tokenized:
    30 s and 4.8 GB at the peak on the demo model), and a good request sent beside four of them is not held up."""
    url, process = cli_server
    huge = json.dumps({**VALID, "questions": {"q": {"type": "noul", "instructions": "i" * 10_000_000}}}).encode()
    with httpx.Client(base_url=url, timeout=60, headers=JSON) as http:
        assert http.post("/v1/systemone", content=huge).status_code == 413  # warm: the first 10 MB body
        assert http.post("/v1/systemone", json=VALID).status_code == 200
        before = _rss(process.pid)
        _peak_rss_reset(process.pid)
        started = time.perf_counter()
        response = http.post("/v1/systemone", content=huge)
        elapsed = time.perf_counter() - started
        peak = _peak_rss(process.pid)
        after = _rss(process.pid)
    assert response.status_code == 413 and response.json()["detail"]["error_type"] == "max_tokens_exceeded"
    assert "the instructions of question 'q'" in response.json()["detail"]["message"]
    print(f"\n10 MB instructions: 413 in {elapsed * 1000:.0f} ms; server RSS {before >> 20} -> {after >> 20} MiB, "
          f"peak {peak >> 20} MiB")
    assert elapsed < 1.0
    assert after - before < 50 << 20, f"RSS grew {(after - before) >> 20} MiB"
    assert peak - before < 200 << 20, f"peak RSS {(peak - before) >> 20} MiB above the level before"

    good: list[float] = []

    def post(body: bytes | None) -> None:
        with httpx.Client(base_url=url, timeout=60, headers=JSON) as http:
            started = time.perf_counter()
            reply = http.post("/v1/systemone", content=body) if body else http.post("/v1/systemone", json=VALID)
            if body is None:
                assert reply.status_code == 200
                good.append(time.perf_counter() - started)

    threads = [threading.Thread(target=post, args=(b,)) for b in (huge, huge, None, huge, huge)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert good and good[0] < 3.0, good  # it used to wait 17 s behind one of them
