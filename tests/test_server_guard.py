"""What ``clef-local serve`` refuses before it costs anything: oversized text, foreign hosts and pages,
non-JSON bodies, duplicate keys. Loopback only; the tiny Llama (8,192-token context, tokens of at most 48 bytes)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from request_gen import varied_requests

import clef_local
from clef_local.errors import MaxTokensExceededError, RequestValidationError
from clef_local.runtime.answers import round_floats
from clef_local.runtime.schema import Limits
from clef_local.server import ServerConfig, ThreadedServer, create_app
from clef_local.server.guard import HostGuard, allowed_host_names, check_origin_value, split_authority

REQUEST: dict[str, Any] = {
    "model": "clef-local",
    "state": "I was charged twice for my coffee.",
    "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer want money back?"},
        "team": {"type": "choice", "criteria": {"cards": "Card payments", "transfers": None}},
        "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
    },
}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> Any:
    return clef_local.load(tiny_llama, dtype="float32")


@pytest.fixture(scope="module")
def server(model: Any) -> Iterator[ThreadedServer]:
    with ThreadedServer(create_app({"clef-local": model}, ServerConfig())) as running:
        yield running


@pytest.fixture
def client(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# ---------------------------------------------------------------- size known before it costs anything


def test_token_bound_is_a_lower_bound(model: Any, tiny_qwen: Path) -> None:
    """``check_size`` never refuses what fits: its count is at most the real token count, on every varied request."""
    from clef_local.runtime.schema import validate_request

    assert model.encoder.max_token_bytes == 48  # the tiny tokenizer's longest token (16 bytes) × NFC's shrink (3)
    qwen = clef_local.load(tiny_qwen)
    checked = 0
    for candidate in (model, qwen):
        for request in varied_requests(40, seed=11):
            try:
                bound = candidate.encoder.check_size(validate_request(request))
                tokens = len(candidate.encode(request).input_ids)
            except MaxTokensExceededError:
                continue
            assert 0 < bound <= tokens
            checked += 1
    assert checked >= 60


@pytest.mark.parametrize(("field", "request_", "named"), [
    ("state", {**REQUEST, "state": "x" * 10_000_000}, "the state"),
    ("instructions", {**REQUEST, "questions": {"q": {"type": "noul", "instructions": "x" * 10_000_000}}},
     "the instructions of question 'q'"),
    ("structured instructions", {**REQUEST, "questions": {"q": {"type": "noul", "instructions": {
        "a": ["é" * 400_000, "b" * 300_000]}}}}, "the instructions of question 'q'"),
    ("description", {**REQUEST, "questions": {"q": {"type": "choice", "criteria": {"a": "d" * 500_000, "b": None}}}},
     "option 'a' of question 'q'"),
    ("score level", {**REQUEST, "questions": {"s": {"type": "score", "criteria": ["low", "🙂" * 200_000]}}},
     "option '1' of question 's'"),
])
def test_one_field_over_the_context_is_refused_at_once(model: Any, field: str, request_: dict[str, Any],
                                                       named: str) -> None:
    started = time.perf_counter()
    with pytest.raises(MaxTokensExceededError) as raised:
        model.decide(request_)  # the Python API (and the CLI) pass through ClefModel.encode → check_size
    assert time.perf_counter() - started < 1.0, field  # tokenizing it would take seconds
    message = str(raised.value)
    assert message.startswith(named) and "the context is 8,192 tokens" in message, message
    assert raised.value.input_tokens > 8192 and raised.value.max_tokens == 8192


def test_many_small_fields_over_the_context(model: Any) -> None:
    """64 questions × 255 options: every option is ≥ 3 pieces of ≥ 1 token, so ≥ 49,000 tokens, known at once."""
    request = {**REQUEST, "questions": {f"q{i}": {"type": "choice", "criteria": {f"o{j}": None for j in range(255)}}
                                        for i in range(64)}}
    started = time.perf_counter()
    with pytest.raises(MaxTokensExceededError, match="the request needs at least 49,"):
        model.decide(request)
    assert time.perf_counter() - started < 1.0
    # with the state truncated, a long state is left out of the bound (and truncated to fit)
    long_state = {**REQUEST, "state": "word " * 100_000}  # 500 kB: over 8,192 × 48 bytes
    from clef_local.runtime.schema import validate_request

    with pytest.raises(MaxTokensExceededError, match="the state"):
        model.encoder.check_size(validate_request(long_state))
    assert model.encoder.check_size(validate_request(long_state), truncate_state=True) < 200
    assert model.decide(long_state, truncate_state=True)["usage"]["input_tokens"] == 8192


def test_ids_and_labels_have_absolute_caps(model: Any, tiny_llama: Path) -> None:
    long_label = {"t": {"type": "choice", "criteria": {"a": None, "b" * 300: None}}}
    for request, what in (({**REQUEST, "questions": {"q" * 257: {"type": "noul"}}}, "question id"),
                          ({**REQUEST, "questions": {"é" * 129: {"type": "noul"}}}, "question id"),  # 258 bytes
                          ({**REQUEST, "questions": long_label}, "choice label")):
        with pytest.raises(RequestValidationError) as raised:
            model.decide(request)
        message = str(raised.value)
        assert f"the {what}" in message and "more than the limit of 256" in message, message
        assert len(message) < 400  # the id is shortened, not echoed
    assert model.decide({**REQUEST, "questions": {"q" * 256: {"type": "noul"}}})["answers"]
    roomy = clef_local.load(tiny_llama, dtype="float32", limits=Limits(max_question_id_bytes=1000))
    assert roomy.decide({**REQUEST, "questions": {"q" * 1000: {"type": "noul"}}})["answers"]


def test_server_refuses_oversized_fields_before_queueing(client: httpx.Client, server: ThreadedServer) -> None:
    """A 10 MB field is 413 (or 422 for an id) in well under a second, and the scheduler never sees it."""
    scheduler = client.get("/metrics").text
    before = _sample(scheduler, "clef_batch_size_count")
    cases = [({**REQUEST, "questions": {"q": {"type": "noul", "instructions": "i" * 10_000_000}}}, 413,
              "max_tokens_exceeded"),
             ({**REQUEST, "questions": {"q": {"type": "choice", "criteria": {"a": None, "l" * 10_000_000: None}}}},
              422, None),
             ({**REQUEST, "questions": {"q" * 10_000_000: {"type": "noul"}}}, 422, None)]
    for body, status, error_type in cases:
        started = time.perf_counter()
        response = client.post("/v1/systemone", json=body)
        assert time.perf_counter() - started < 2.0
        assert response.status_code == status, response.text[:300]
        assert len(response.content) < 2000  # the 10 MB value is not echoed
        if error_type:
            assert response.json()["detail"]["error_type"] == error_type
            assert "instructions of question 'q'" in response.json()["detail"]["message"]
    assert _sample(client.get("/metrics").text, "clef_batch_size_count") == before
    assert client.post("/v1/systemone", json=REQUEST).status_code == 200


def _sample(metrics: str, name: str) -> float:
    """A sample's value (0 before the first observation: an empty histogram has no lines)."""
    return float(next((line.split()[-1] for line in metrics.splitlines() if line.startswith(name + " ")), 0))


# ---------------------------------------------------------------- a web page cannot drive the server


@pytest.mark.parametrize(("content_type", "fragment"), [
    ("text/plain", "'text/plain'"),
    ("text/plain;charset=UTF-8", "'text/plain'"),
    ("application/x-www-form-urlencoded", "'application/x-www-form-urlencoded'"),
    ("image/png", "'image/png'"),
    ("multipart/mixed; boundary=x", "multipart bodies"),
    (None, "no Content-Type"),
    ("application/json; charset=latin-1", "charset 'latin-1'"),
])
def test_only_json_bodies(client: httpx.Client, content_type: str | None, fragment: str) -> None:
    body = json.dumps(REQUEST).encode()
    headers = {"content-type": content_type} if content_type else {}
    request = client.build_request("POST", "/v1/systemone", content=body, headers=headers)
    assert ("content-type" in request.headers) == (content_type is not None)
    response = client.send(request)
    assert response.status_code == 415, response.text
    assert response.json()["detail"]["error_type"] == "unsupported_media_type"
    assert fragment in response.json()["detail"]["message"]
    assert "application/json" in response.json()["detail"]["message"]


def test_a_web_pages_multipart_post_is_refused_by_its_origin(client: httpx.Client) -> None:
    """multipart/form-data carries assets, and a browser may send it cross-origin without a preflight: the page's
    Origin is what refuses it."""
    files = {"request": ("request.json", json.dumps(REQUEST).encode(), "application/json")}
    response = client.post("/v1/systemone", files=files, headers={"origin": "https://evil.example"})
    assert response.status_code == 403 and response.json()["detail"]["error_type"] == "forbidden_origin"


def test_json_content_types_accepted(client: httpx.Client, model: Any) -> None:
    expected = round_floats(model.decide(REQUEST), 4)
    for content_type in ("application/json", "Application/JSON", "application/json; charset=utf-8",
                         'application/json;charset="UTF-8"'):
        response = client.post("/v1/systemone", content=json.dumps(REQUEST), headers={"content-type": content_type})
        assert response.status_code == 200, content_type
        assert response.json() == expected


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(request)
        chunks = []
        while chunk := raw.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_foreign_host_is_refused(client: httpx.Client, server: ThreadedServer) -> None:
    for host in ("evil.example", "evil.example:8077", "127.0.0.1.nip.io", "localhost.evil.example", "0.0.0.0",
                 "[::2]", "127.0.0.1:80:80", "::1"):
        for method, path in (("POST", "/v1/systemone"), ("GET", "/health"), ("GET", "/v1/models")):
            response = client.request(method, path, json=REQUEST if method == "POST" else None,
                                      headers={"host": host})
            assert response.status_code == 400, (host, path)
            assert response.json()["detail"]["error_type"] == "invalid_host"
            assert "--allowed-host" in response.json()["detail"]["message"]
    for host in ("127.0.0.1", f"127.0.0.1:{server.port}", "localhost:1", "LOCALHOST", "[::1]", "[::1]:8077"):
        assert client.post("/v1/systemone", json=REQUEST, headers={"host": host}).status_code == 200, host
    # HTTP/1.0 without Host; two Host headers (the second would be the rebinding one)
    reply = _raw(server.port, b"GET /health HTTP/1.0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400") and b"invalid_host" in reply
    reply = _raw(server.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n"
                              b"Connection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400")  # h11 refuses it already; the guard too, behind other HTTP parsers
    guard = HostGuard(None, allowed_host_names("127.0.0.1"))
    assert guard.refusal({b"host": b"127.0.0.1"}, hosts=2) == (400, "invalid_host",
                                                               "the request has several Host headers; send one")
    assert guard.refusal({b"host": b"127.0.0.1:8077"}) is None


def test_allowed_hosts_and_bound_address(model: Any) -> None:
    config = ServerConfig(host="0.0.0.0", allowed_hosts=("my-box.local", "192.168.1.4"))
    assert config.host_names == {"localhost", "127.0.0.1", "[::1]", "0.0.0.0", "my-box.local", "192.168.1.4"}
    with ThreadedServer(create_app({"clef-local": model}, config)) as running:  # bound to 127.0.0.1 all the same
        for host, status in (("my-box.local:8077", 200), ("MY-BOX.LOCAL", 200), ("192.168.1.4", 200),
                             ("0.0.0.0:8077", 200), ("other.local", 400)):
            assert httpx.get(running.url + "/health", headers={"host": host}).status_code == status, host
    for bad in ("my-box:80", "a b", ""):
        with pytest.raises(ValueError, match="--allowed-host"):
            ServerConfig(allowed_hosts=(bad,))
    assert allowed_host_names("::1") == {"localhost", "127.0.0.1", "[::1]"}
    assert split_authority("[0:0::1]:5") == ("[::1]", 5) and split_authority("::1") is None


def test_foreign_origin_is_refused_and_no_cors_by_default(client: httpx.Client, server: ThreadedServer) -> None:
    for origin in ("http://evil.example", "null", "http://localhost:3000", f"https://127.0.0.1:{server.port}x"):
        response = client.post("/v1/systemone", json=REQUEST, headers={"origin": origin})
        assert response.status_code == 403, origin
        assert response.json()["detail"]["error_type"] == "forbidden_origin"
        assert not [h for h in response.headers if h.startswith("access-control-")]
    preflight = client.options("/v1/systemone", headers={"origin": "http://evil.example",
                                                          "access-control-request-method": "POST"})
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    # the server's own pages (/docs) are same-origin
    own = client.post("/v1/systemone", json=REQUEST, headers={"origin": f"http://127.0.0.1:{server.port}"})
    assert own.status_code == 200 and "access-control-allow-origin" not in own.headers
    assert "access-control-allow-origin" not in client.get("/health").headers


def test_cors_origins(model: Any) -> None:
    config = ServerConfig(cors_origins=("http://LOCALHOST:3000/",))
    assert config.cors_origins == ("http://localhost:3000",)
    with ThreadedServer(create_app({"clef-local": model}, config)) as running, \
            httpx.Client(base_url=running.url, timeout=60) as c:
        preflight = c.options("/v1/systemone", headers={
            "origin": "http://localhost:3000", "access-control-request-method": "POST",
            "access-control-request-headers": "content-type, authorization"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        ok = c.post("/v1/systemone", json=REQUEST, headers={"origin": "http://localhost:3000"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = c.post("/v1/systemone", json=REQUEST, headers={"origin": "http://localhost:3001"})
        assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    for bad in ("*", "localhost:3000", "http://localhost:3000/app", "ftp://x"):
        with pytest.raises(ValueError, match="--cors-origin"):
            ServerConfig(cors_origins=(bad,))
    assert check_origin_value("https://[::1]:8443") == "https://[::1]:8443"


# ---------------------------------------------------------------- duplicate keys


@pytest.mark.parametrize(("body", "key"), [
    (b'{"model": "clef-local", "model": "jev-latest", "state": "x", "questions": {"q": {"type": "noul"}}}', "model"),
    (b'{"model": "clef-local", "state": "x", "questions": {"q": {"type": "noul"}, "q": {"type": "score"}}}', "q"),
    (b'{"model": "clef-local", "state": "x", "questions": {"q": {"type": "noul", "type": "choice"}}}', "type"),
    (b'{"model": "clef-local", "state": {"a": [{"deep": 1, "deep": 2}]}, "questions": {"q": {"type": "noul"}}}',
     "deep"),
    (b'{"model": "clef-local", "state": "x", "questions": {"q": {"type": "choice", '
     b'"criteria": {"a": null, "b": "x", "a": "y"}}}}', "a"),
])
def test_duplicate_keys_are_422(client: httpx.Client, body: bytes, key: str) -> None:
    response = client.post("/v1/systemone", content=body, headers=JSON)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail[0]["type"] == "json_duplicate_key"
    assert f"the key {key!r} appears twice" in detail[0]["msg"]


def test_compressed_bodies_with_trailing_bytes(client: httpx.Client, model: Any) -> None:
    """Two gzip members are one body (RFC 1952); bytes after a gzip or deflate stream that are not one are 400."""
    import gzip
    import zlib

    raw = json.dumps(REQUEST).encode()
    members = gzip.compress(raw[:40]) + gzip.compress(raw[40:])
    ok = client.post("/v1/systemone", content=members, headers={**JSON, "content-encoding": "gzip"})
    assert ok.status_code == 200 and ok.json() == round_floats(model.decide(REQUEST), 4)
    for encoding, body in (("gzip", gzip.compress(raw) + b"trailing"), ("deflate", zlib.compress(raw) + b"x")):
        response = client.post("/v1/systemone", content=body, headers={**JSON, "content-encoding": encoding})
        assert response.status_code == 400, encoding
        assert response.json()["detail"]["error_type"] == "invalid_content_encoding"
