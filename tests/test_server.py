"""``clef-local serve``: routes, bodies, error shapes, auth, limits, 429, metrics, envelope, shutdown (loopback)."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import clef_local
from clef_local.errors import ApiUsageError, MaxTokensExceededError
from clef_local.runtime.answers import round_floats
from clef_local.server import ServerConfig, ThreadedServer, create_app
from clef_local.server.config import bind_warning, is_loopback, parse_model_specs

try:
    from compression import zstd  # type: ignore[import-not-found]  # Python 3.14+
except ImportError:
    from backports import zstd

REQUEST: dict[str, Any] = {
    "model": "clef-local",
    "state": "I was charged twice for my coffee.",
    "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer want money back?"},
        "team": {"type": "choice", "criteria": {"cards": "Card payments", "transfers": None, "other": None}},
        "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
    },
}


POISON = "a state this model's backend fails on"


class GatedModel:
    """A real model whose ``run`` waits for ``gate`` (to hold a batch in flight), records the records it is given
    and fails any batch holding the :data:`POISON` state (as a backend error would)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.sizes: list[int] = []

    def run(self, records: list[Any], **kwargs: Any) -> Iterator[Any]:
        self.sizes.append(len(records))
        self.entered.set()
        if not self.gate.wait(timeout=30):
            raise TimeoutError("gate never opened")
        if any(r.request.state == POISON for r in records):
            raise ApiUsageError("this record cannot be run")
        return self.model.run(records, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> Any:
    return clef_local.load(tiny_llama, dtype="float32", state_cache="auto")  # as serve loads it


@pytest.fixture(scope="module")
def server(model: Any) -> Iterator[ThreadedServer]:
    with ThreadedServer(create_app({"clef-local": model}, ServerConfig())) as running:
        yield running


@pytest.fixture
def client(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def wait_until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def post_in_thread(url: str, body: Any, results: list[Any], **kwargs: Any) -> threading.Thread:
    def run() -> None:
        try:
            results.append(httpx.post(url, json=body, timeout=60, **kwargs))
        except httpx.HTTPError as exc:
            results.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------- the happy path


def test_systemone_matches_direct_decide(client: httpx.Client, model: Any) -> None:
    response = client.post("/v1/systemone", json=REQUEST)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert response.json() == round_floats(model.decide(REQUEST), 4)


def test_jev_alias_unknown_fields_and_model_name(client: httpx.Client, model: Any) -> None:
    for alias in ("jev-latest", "jev-preview"):
        response = client.post("/v1/systemone", json={**REQUEST, "model": alias, "x_trace": 1, "seed": [1, 2]})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "clef-local"  # the served model answers, under its own name
        assert response.json()["answers"] == round_floats(model.decide(REQUEST), 4)["answers"]
    unknown = client.post("/v1/systemone", json={**REQUEST, "model": "gpt-4"})
    assert unknown.status_code == 400
    assert unknown.json()["detail"]["error_type"] == "api_usage_error"
    assert "clef-local" in unknown.json()["detail"]["message"]


def test_health_models_openapi(client: httpx.Client) -> None:
    assert client.get("/health").json()["status"] == "ok"
    models = client.get("/v1/models").json()["models"]
    assert [m["name"] for m in models] == ["clef-local", "jev-latest", "jev-preview"]
    for entry in models:
        assert all(isinstance(entry[k], str) and entry[k] for k in ("name", "description", "release_date"))
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", entry["release_date"])
    spec = client.get("/openapi.json").json()
    for path in ("/v1/systemone", "/v1/models", "/health", "/metrics",
                 "/accounts/{account}/ai/run/@cf/cloudflare/{model}"):
        assert path in spec["paths"]
    body = spec["paths"]["/v1/systemone"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/SystemOneRequest")
    assert "Question" in spec["components"]["schemas"]
    assert client.get("/docs").status_code == 200


def test_cloudflare_envelope(client: httpx.Client, model: Any) -> None:
    path = "/accounts/0123abc/ai/run/@cf/cloudflare/clef-local"
    body = {k: v for k, v in REQUEST.items() if k != "model"}  # the path names the model
    ok = client.post(path, json=body)
    assert ok.status_code == 200
    assert ok.json() == {"result": round_floats(model.decide(REQUEST), 4), "success": True, "errors": [],
                         "messages": []}
    bad = client.post(path, json={"state": "x"})
    assert bad.status_code == 422
    assert bad.json()["success"] is False and bad.json()["result"] is None
    assert bad.json()["errors"][0]["code"] == 422
    unknown = client.post("/accounts/0123abc/ai/run/@cf/cloudflare/clef-flash", json=body)
    assert unknown.status_code == 400 and unknown.json()["errors"][0]["error_type"] == "api_usage_error"


# ---------------------------------------------------------------- bodies


def test_compressed_bodies(client: httpx.Client, model: Any) -> None:
    raw = json.dumps(REQUEST).encode()
    expected = round_floats(model.decide(REQUEST), 4)
    for encoding, data in (("zstd", zstd.compress(raw)), ("gzip", gzip.compress(raw))):
        response = client.post("/v1/systemone", content=data,
                               headers={"content-encoding": encoding, "content-type": "application/json"})
        assert response.status_code == 200, response.text
        assert response.json() == expected
    # a streamed zstd frame (no content size in its header), as some clients write it
    stream = zstd.ZstdCompressor()
    framed = stream.compress(raw) + stream.flush()
    assert zstd.get_frame_info(framed).decompressed_size is None
    assert client.post("/v1/systemone", content=framed,
                       headers={"content-encoding": "zstd", "content-type": "application/json"}).status_code == 200


@pytest.mark.parametrize(("encoding", "data", "status", "error_type"), [
    ("zstd", b"not zstd at all", 400, "invalid_content_encoding"),
    ("zstd", zstd.compress(b'{"model": "x"}')[:-3], 400, "invalid_content_encoding"),
    ("gzip", b"\x1f\x8b\x08garbage", 400, "invalid_content_encoding"),
    ("br", b"{}", 415, "unsupported_media_type"),
    # a bomb: 20 MiB of zeros in ~1 KiB of zstd, refused while decompressing
    ("zstd", zstd.compress(b"\0" * (20 << 20)), 413, "request_too_large"),
])
def test_bad_encodings(client: httpx.Client, encoding: str, data: bytes, status: int, error_type: str) -> None:
    response = client.post("/v1/systemone", content=data,
                           headers={"content-encoding": encoding, "content-type": "application/json"})
    assert response.status_code == status
    assert response.json()["detail"]["error_type"] == error_type


def test_body_limit_is_13_mib(client: httpx.Client) -> None:
    big = json.dumps({**REQUEST, "state": "x" * (13 * 1024 * 1024)}).encode()
    response = client.post("/v1/systemone", content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["detail"]["error_type"] == "request_too_large"
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize(("body", "loc_type"), [
    (b'{"model": "clef-local", "state": ', "json_invalid"),
    (b"", "missing"),
    (b'{"model": "clef-local", "state": "caf\xe9"}', "json_invalid"),  # Latin-1, not UTF-8
    (b'{"model": "clef-local", "state": NaN, "questions": {}}', "json_invalid"),
    (b'{"model": "clef-local", "state": "\\udc00", "questions": {"q": {"type": "noul"}}}', "string_unicode"),
    (b"[" * 200 + b"]" * 200, "json_too_deep"),
    (b"[" * 100_000 + b"]" * 100_000, "json_too_deep"),
    (b'{"model": "clef-local", "state": ' + b"9" * 5000 + b', "questions": {}}', "json_invalid"),
    (b'"just a string"', "model_type"),
    (b'{"model": "clef-local", "state": "x", "questions": {}}', "too_short"),
])
def test_malformed_bodies_get_422_detail_lists(client: httpx.Client, body: bytes, loc_type: str) -> None:
    response = client.post("/v1/systemone", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, list) and detail
    assert all(d["loc"][0] == "body" and isinstance(d["msg"], str) for d in detail)
    assert loc_type in {d["type"] for d in detail}


def test_limits_and_max_tokens(client: httpx.Client, tiny_llama: Path) -> None:
    over = {**REQUEST, "questions": {"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}}}
    assert client.post("/v1/systemone", json=over).status_code == 422
    levels = {**REQUEST, "questions": {"q": {"type": "score", "criteria": [f"l{i}" for i in range(11)]}}}
    assert client.post("/v1/systemone", json=levels).status_code == 422
    ok = {**REQUEST, "questions": {"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(255)}},
                                   "s": {"type": "score", "criteria": [f"l{i}" for i in range(10)]}}}
    assert client.post("/v1/systemone", json=ok).status_code == 200
    short = clef_local.load(tiny_llama, dtype="float32", max_length=400)
    with ThreadedServer(create_app({"clef-local": short})) as running:
        response = httpx.post(running.url + "/v1/systemone", json={**REQUEST, "state": "word " * 1000}, timeout=60)
    assert response.status_code == 413
    assert response.json()["detail"]["error_type"] == "max_tokens_exceeded"


def test_huge_state_refused_before_tokenizing(client: httpx.Client) -> None:
    started = time.perf_counter()
    response = client.post("/v1/systemone", json={**REQUEST, "state": "é🙂" * 700_000})  # 4.2 MB > 256 × 8192
    assert response.status_code == 413
    assert response.json()["detail"]["error_type"] == "max_tokens_exceeded"
    assert "at least" in response.json()["detail"]["message"]
    assert time.perf_counter() - started < 5  # tokenizing it would take seconds and gigabytes


def test_unknown_routes_and_methods(client: httpx.Client) -> None:
    missing = client.get("/v2/nothing")
    assert missing.status_code == 404 and missing.json()["detail"]["error_type"] == "not_found"
    wrong = client.get("/v1/systemone")
    assert wrong.status_code == 405 and wrong.json()["detail"]["error_type"] == "method_not_allowed"
    # multipart bodies carry images (tests/test_server_media.py); this one's request part is not a request
    multipart = client.post("/v1/systemone", files={"request": ("r.json", b"{}", "application/json")})
    assert multipart.status_code == 422 and multipart.json()["detail"][0]["loc"] == ["body", "model"]


# ---------------------------------------------------------------- auth


def test_auth_off_accepts_any_header(client: httpx.Client) -> None:
    for header in ("Bearer whatever", "Basic Zm9vOmJhcg==", "garbage"):
        assert client.post("/v1/systemone", json=REQUEST, headers={"authorization": header}).status_code == 200


def test_api_key(model: Any) -> None:
    app = create_app({"clef-local": model}, ServerConfig(api_key="s3cret"))
    with ThreadedServer(app) as running, httpx.Client(base_url=running.url, timeout=60) as c:
        missing = c.post("/v1/systemone", json=REQUEST)
        assert missing.status_code == 401
        assert missing.json()["detail"]["error_type"] == "authentication_error"
        assert missing.headers["www-authenticate"] == "Bearer"
        for header in ("Bearer wrong", "Bearer s3cret2", "Basic s3cret", "s3cret"):
            wrong = c.post("/v1/systemone", json=REQUEST, headers={"authorization": header})
            assert wrong.status_code == 401, header
        good = {"authorization": "Bearer s3cret"}
        assert c.post("/v1/systemone", json=REQUEST, headers=good).status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers=good).status_code == 200
        assert c.get("/metrics").status_code == 401
        assert c.get("/health").status_code == 200  # liveness probes carry no key
        cf = c.post("/accounts/a/ai/run/@cf/cloudflare/clef-local", json=REQUEST)
        assert cf.status_code == 401 and cf.json()["success"] is False


def test_bind_warning_and_config() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("127.8.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4") and not is_loopback("example.org")
    assert bind_warning("127.0.0.1", None) is None
    assert bind_warning("0.0.0.0", "key") is None
    assert "--api-key" in (bind_warning("0.0.0.0", None) or "")
    assert parse_model_specs(["a=/x", "b=/y"]) == {"a": Path("/x"), "b": Path("/y")}
    assert parse_model_specs(["/x"]) == {"clef-local": Path("/x")}
    with pytest.raises(ValueError, match="twice"):
        parse_model_specs(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="max-batch"):
        ServerConfig(max_batch=0)


# ---------------------------------------------------------------- batching, 429, shutdown


def test_queue_full_gets_429_with_retry_after(model: Any) -> None:
    gated = GatedModel(model)
    config = ServerConfig(max_batch=1, max_wait_ms=0, max_queue=1)
    app = create_app({"clef-local": gated}, config)
    scheduler = app.state.clef.scheduler
    with ThreadedServer(app) as running:
        url = running.url + "/v1/systemone"
        results: list[Any] = []
        first = post_in_thread(url, REQUEST, results)
        assert gated.entered.wait(10)  # the first request is computing (held at the gate)
        second = post_in_thread(url, REQUEST, results)
        wait_until(lambda: scheduler.queue_depth == 1)  # the second waits in the queue
        refused = httpx.post(url, json=REQUEST, timeout=30)
        assert refused.status_code == 429
        assert refused.json()["detail"]["error_type"] == "rate_limit_error"
        assert int(refused.headers["retry-after"]) >= 1
        assert int(refused.headers["retry-after-ms"]) >= 1000
        gated.gate.set()
        first.join(30)
        second.join(30)
        assert [r.status_code for r in results] == [200, 200]
        metrics = httpx.get(running.url + "/metrics").text
        assert 'clef_requests_total{route="/v1/systemone",status="429"} 1' in metrics


def test_errors_stay_with_their_request_in_a_batch(tiny_llama: Path) -> None:
    """A request over the context is refused before the queue (413); a batch that fails in the model is re-run one
    by one, so only the request that causes the failure gets an error."""
    short = clef_local.load(tiny_llama, dtype="float32", max_length=450)
    too_long = {**REQUEST, "state": "word " * 60}  # about as long as the others, but over 450 tokens
    with pytest.raises(MaxTokensExceededError):
        short.decide(too_long)
    gated = GatedModel(short)
    app = create_app({"clef-local": gated}, ServerConfig(max_batch=8, max_wait_ms=0))
    scheduler = app.state.clef.scheduler
    with ThreadedServer(app) as running:
        url = running.url + "/v1/systemone"
        results: list[Any] = []
        threads = [post_in_thread(url, REQUEST, results)]
        assert gated.entered.wait(10)
        batch = [REQUEST, too_long, {**REQUEST, "state": POISON}, {**REQUEST, "state": "another state"}]
        outcomes: list[list[Any]] = [[] for _ in batch]
        threads += [post_in_thread(url, body, out) for body, out in zip(batch, outcomes, strict=True)]
        wait_until(lambda: all(outcomes[1]) and scheduler.queue_depth == 3)
        gated.gate.set()
        for thread in threads:
            thread.join(30)
    assert results[0].status_code == 200
    assert [out[0].status_code for out in outcomes] == [200, 413, 400, 200]
    assert outcomes[1][0].json()["detail"]["error_type"] == "max_tokens_exceeded"
    assert outcomes[2][0].json()["detail"]["message"] == "this record cannot be run"
    assert outcomes[3][0].json() == round_floats(short.decide({**REQUEST, "state": "another state"}), 4)
    assert gated.sizes[:2] == [1, 3]  # the three queued requests went as one batch, then one by one


def test_graceful_shutdown_finishes_in_flight(model: Any) -> None:
    gated = GatedModel(model)
    running = ThreadedServer(create_app({"clef-local": gated}, ServerConfig())).start()
    results: list[Any] = []
    thread = post_in_thread(running.url + "/v1/systemone", REQUEST, results)
    assert gated.entered.wait(10)
    stopper = threading.Thread(target=running.stop, daemon=True)
    stopper.start()
    time.sleep(0.3)  # the server is shutting down with one request in flight
    assert stopper.is_alive()
    gated.gate.set()
    thread.join(30)
    stopper.join(30)
    assert results and not isinstance(results[0], Exception) and results[0].status_code == 200
    assert not running.thread.is_alive()


# ---------------------------------------------------------------- metrics


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? '
                    r"(-?[0-9.e+-]+|\+Inf|-Inf|NaN)$")


def test_metrics_text_format(client: httpx.Client) -> None:
    for _ in range(3):
        client.post("/v1/systemone", json=REQUEST)
    client.post("/v1/systemone", content=b"{", headers={"content-type": "application/json"})  # 422
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line.startswith("# HELP "):
            continue
        else:
            match = SAMPLE.match(line)
            assert match, f"not a Prometheus sample line: {line!r}"
            samples[line.rsplit(" ", 1)[0]] = float(line.rsplit(" ", 1)[1])
    assert types == {"clef_requests_total": "counter", "clef_request_duration_seconds": "histogram",
                     "clef_batch_size": "histogram", "clef_batch_inference_seconds": "histogram",
                     "clef_queue_depth": "gauge", "clef_requests_in_batch": "gauge", "clef_uptime_seconds": "gauge",
                     "clef_request_bodies_total": "counter", "clef_state_cache_hits_total": "counter",
                     "clef_state_cache_misses_total": "counter", "clef_state_cache_evictions_total": "counter",
                     "clef_state_cache_memory_clears_total": "counter", "clef_state_cache_bytes": "gauge",
                     "clef_state_cache_budget_bytes": "gauge", "clef_state_cache_entries": "gauge"}
    assert samples['clef_requests_total{route="/v1/systemone",status="200"}'] >= 3
    assert samples['clef_requests_total{route="/v1/systemone",status="422"}'] >= 1
    route = 'route="/v1/systemone"'
    # the bucket's labels in any order (prometheus_client sorts them: le before route)
    buckets = [v for k, v in samples.items() if k.startswith("clef_request_duration_seconds_bucket{") and route in k]
    assert len(buckets) == 13
    assert buckets == sorted(buckets)  # cumulative
    assert buckets[-1] == samples["clef_request_duration_seconds_count{" + route + "}"]
    assert samples['clef_batch_size_bucket{le="+Inf"}'] == samples["clef_batch_size_count"] >= 3
    assert samples["clef_queue_depth"] == 0
    # the same state three times: one state pass, then hits (tests/test_state_cache_use.py checks the numbers)
    assert samples['clef_state_cache_hits_total{model="clef-local"}'] >= 2
    assert samples['clef_state_cache_budget_bytes{memory="host",model="clef-local"}'] == 0


# ---------------------------------------------------------------- CLI


def test_cli_serve_help_is_light() -> None:
    code = ("import sys\nfrom clef_local.cli import main\ntry:\n    main(['serve', '--help'])\nexcept SystemExit:\n"
            "    pass\nheavy = [m for m in ('torch', 'fastapi', 'uvicorn', 'transformers') if m in sys.modules]\n"
            "print('HEAVY', heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "--max-batch" in out and "--api-key" in out and "NAME=DIR" in out
    assert "HEAVY []" in out


def test_serve_warns_off_loopback_without_key(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                              model: Any) -> None:
    import uvicorn

    import clef_local.server.run as run

    loaded: dict[str, Any] = {}
    ran: dict[str, Any] = {}
    monkeypatch.setattr(run, "load_models", lambda specs, **kw: loaded.update(specs=specs, **kw) or {"m": model})
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.update(kw, app=app))  # nothing is bound
    assert run.serve(["m=/some/release"], host="0.0.0.0", port=9999, confidence="reference") == 0
    assert "without --api-key" in capsys.readouterr().err
    assert loaded["specs"] == {"m": Path("/some/release")} and loaded["confidence"] == "reference"
    assert (ran["host"], ran["port"], ran["timeout_graceful_shutdown"]) == ("0.0.0.0", 9999, 30)
    run.serve(["m=/some/release"], host="127.0.0.1")
    run.serve(["m=/some/release"], host="0.0.0.0", api_key="k")
    assert "WARNING" not in capsys.readouterr().err


def test_cli_serve_passes_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    import clef_local.server.run as run
    from clef_local.cli import main

    seen: dict[str, Any] = {}

    def fake_serve(specs: Any, **kwargs: Any) -> int:
        seen.update(kwargs, specs=list(specs))
        return 0

    monkeypatch.setattr(run, "serve", fake_serve)
    assert main(["serve", "--model", "a=/x", "--model", "b=/y", "--port", "9000", "--max-batch", "4",
                 "--max-wait-ms", "2", "--max-queue", "3", "--api-key", "k", "--confidence", "reference"]) == 0
    assert seen["specs"] == ["a=/x", "b=/y"]
    assert (seen["port"], seen["max_batch"], seen["max_wait_ms"], seen["max_queue"]) == (9000, 4, 2.0, 3)
    assert (seen["api_key"], seen["confidence"], seen["host"]) == ("k", "reference", "127.0.0.1")


@pytest.mark.parametrize(("command", "blocked", "extra"), [
    ("serve", "uvicorn", "serve"), ("serve", "fastapi", "serve"), ("ui", "gradio", "ui")])
def test_missing_extra_fails_at_once(command: str, blocked: str, extra: str, tmp_path: Path) -> None:
    """Without its extra a command says how to install it in one line, exit status 2, before loading any model."""
    code = (f"import sys\nsys.modules[{blocked!r}] = None  # as if it were not installed\n"
            "from clef_local.cli import main\n"
            f"status = main([{command!r}, '--model', {str(tmp_path / 'no-release')!r}])\n"
            "print('TORCH', 'torch' in sys.modules)\nsys.exit(status)\n")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"error: clef-local {command} needs {blocked}, which is not installed: pip install 'clef-local[{extra}]'"]
    assert "TORCH False" in done.stdout  # no model was loaded (nor the release looked at: it does not exist)
    assert time.perf_counter() - started < 30


def test_each_app_keeps_its_own_metrics_registry() -> None:
    """One prometheus_client registry per app: two apps in a process (the tests' many) never share counts, and the
    process-wide default registry is left alone."""
    from prometheus_client import REGISTRY

    from clef_local.server.metrics import ServerMetrics

    first, second = ServerMetrics(), ServerMetrics()
    first.requests.labels("/health", "200").inc()
    first.batch_size.observe(3)
    assert first.sample("clef_requests_total", route="/health", status="200") == 1
    assert second.sample("clef_requests_total", route="/health", status="200") == 0
    assert first.sample("clef_batch_size_bucket", le="4.0") == 1 and first.sample("clef_batch_size_sum") == 3
    assert REGISTRY.get_sample_value("clef_requests_total", {"route": "/health", "status": "200"}) is None
    assert "_created" not in first.render()
