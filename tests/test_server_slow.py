"""Slow and surplus clients of ``clef-local serve``: slowloris connections are dropped on time while
normal requests are answered, and connections beyond ``--max-connections`` get 503 at once. Loopback only."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

import clef_local
from clef_local.server import ServerConfig, ThreadedServer, create_app

REQUEST: dict[str, Any] = {"model": "clef-local", "state": "Refund the double charge, please.",
                           "questions": {"refund": {"type": "noul"}}}
HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.5
MARGIN = 1.5  # seconds past the deadline by which the server must have closed (the test loop polls every 0.05 s)


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> Any:
    return clef_local.load(tiny_llama, dtype="float32")


@dataclass
class Slow:
    """One hostile connection: what it sent first, what it trickles, and what became of it."""

    kind: str  # "headers" | "body" | "idle"
    sock: socket.socket
    opened: float
    trickle: bytes
    reply: bytearray = field(default_factory=bytearray)
    closed_after: float | None = None


def _open(port: int, kind: str) -> Slow:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    opened = time.monotonic()
    if kind == "headers":  # the request line and one header, then a header byte at a time
        sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        trickle = b"a"
    elif kind == "body":  # complete headers, then a body far shorter than its Content-Length, a byte at a time
        sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{")
        trickle = b" "
    else:  # connects and says nothing
        trickle = b""
    sock.setblocking(False)
    return Slow(kind, sock, opened, trickle)


def _poll(conn: Slow, now: float, send: bool) -> None:
    """Trickle a byte (when ``send``) and collect what the server sent; note when it closed the connection."""
    try:
        if send and conn.trickle:
            conn.sock.send(conn.trickle)
        while True:
            chunk = conn.sock.recv(65536)
            if not chunk:
                raise ConnectionResetError
            conn.reply += chunk
    except BlockingIOError:
        return
    except OSError:  # reset, broken pipe or EOF: the server closed it
        conn.closed_after = now - conn.opened
        conn.sock.close()


def test_slowloris_connections_are_closed_on_time(model: Any) -> None:
    config = ServerConfig(header_timeout_s=HEADER_TIMEOUT, body_timeout_s=BODY_TIMEOUT)
    with ThreadedServer(create_app({"clef-local": model}, config)) as running:
        conns = [_open(running.port, kind) for kind in ["headers"] * 20 + ["body"] * 20 + ["idle"] * 10]
        answered: list[Any] = []

        def normal() -> None:  # a well-behaved client, while the 50 are trickling
            started = time.monotonic()
            response = httpx.post(running.url + "/v1/systemone", json=REQUEST, timeout=30)
            answered.append((response.status_code, time.monotonic() - started))

        client = threading.Thread(target=normal)
        client.start()
        deadline = time.monotonic() + BODY_TIMEOUT + MARGIN + 3
        tick = 0
        while any(c.closed_after is None for c in conns) and time.monotonic() < deadline:
            now = time.monotonic()
            for conn in conns:
                if conn.closed_after is None:
                    _poll(conn, now, send=tick % 6 == 0)  # a byte every 0.3 s: each keeps "making progress"
            tick += 1
            time.sleep(0.05)
        client.join(30)
        for conn in conns:
            if conn.closed_after is None:
                conn.sock.close()
        assert answered and answered[0][0] == 200, answered
        assert answered[0][1] < 5.0, answered
        assert httpx.get(running.url + "/health").status_code == 200
    still_open = [c.kind for c in conns if c.closed_after is None]
    assert not still_open, f"{len(still_open)} of {len(conns)} slow connections still open: {still_open}"
    for conn in conns:
        limit = BODY_TIMEOUT if conn.kind == "body" else HEADER_TIMEOUT
        assert conn.closed_after is not None and limit - 0.1 <= conn.closed_after <= limit + MARGIN, \
            (conn.kind, conn.closed_after)
        if conn.kind == "idle":  # nothing was asked, nothing is answered
            assert conn.reply == b""
        else:
            assert conn.reply.startswith(b"HTTP/1.1 408 "), (conn.kind, bytes(conn.reply[:200]))
            assert b'"request_timeout"' in conn.reply and b"connection: close" in conn.reply.lower()


def test_connections_beyond_the_limit_get_503_at_once(model: Any) -> None:
    config = ServerConfig(max_connections=4)
    with ThreadedServer(create_app({"clef-local": model}, config)) as running:
        idle = [socket.create_connection(("127.0.0.1", running.port), timeout=5) for _ in range(4)]
        time.sleep(0.3)  # the server has accepted all four
        started = time.monotonic()
        refused = httpx.post(running.url + "/v1/systemone", json=REQUEST, timeout=10)
        assert time.monotonic() - started < 2.0
        assert refused.status_code == 503
        assert refused.json()["detail"]["error_type"] == "too_many_connections"
        assert refused.headers["retry-after"] == "1" and refused.headers["connection"] == "close"
        for sock in idle:
            sock.close()
        time.sleep(0.3)
        assert httpx.post(running.url + "/v1/systemone", json=REQUEST, timeout=30).status_code == 200


def test_early_answer_does_not_keep_a_trickling_body_open(model: Any) -> None:
    """A request refused on its headers (a foreign Host) is answered at once; the body it keeps trickling does not
    hold the connection past the body deadline."""
    config = ServerConfig(header_timeout_s=HEADER_TIMEOUT, body_timeout_s=BODY_TIMEOUT)
    with ThreadedServer(create_app({"clef-local": model}, config)) as running:
        sock = socket.create_connection(("127.0.0.1", running.port), timeout=5)
        sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: evil.example\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{")
        conn = Slow("body", sock, time.monotonic(), b" ")
        sock.setblocking(False)
        tick = 0
        while conn.closed_after is None and time.monotonic() - conn.opened < BODY_TIMEOUT + MARGIN + 2:
            _poll(conn, time.monotonic(), send=tick % 6 == 0)
            tick += 1
            time.sleep(0.05)
    assert conn.reply.startswith(b"HTTP/1.1 400 ") and b"invalid_host" in conn.reply
    assert conn.closed_after is not None and conn.closed_after <= BODY_TIMEOUT + MARGIN


def test_timeouts_and_limit_are_validated() -> None:
    for kwargs, flag in (({"header_timeout_s": 0}, "--header-timeout"), ({"body_timeout_s": -1}, "--body-timeout"),
                         ({"max_connections": 0}, "--max-connections")):
        with pytest.raises(ValueError, match=flag):
            ServerConfig(**kwargs)


def test_garbled_body_after_good_headers(model: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Headers the application starts on, then a chunked body that breaks HTTP: the client gets one 400 and the
    server logs no error (uvicorn alone would let the application answer into the broken connection: a traceback)."""
    with ThreadedServer(create_app({"clef-local": model}, ServerConfig(api_key="k"))) as running:
        with socket.create_connection(("127.0.0.1", running.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\nzz\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        time.sleep(0.3)  # the application task has run
        assert httpx.get(running.url + "/health").status_code == 200
    assert reply.startswith(b"HTTP/1.1 400 ") and reply.count(b"HTTP/1.1") == 1, reply
    assert not [r for r in caplog.records if r.levelno >= 40], [r.getMessage() for r in caplog.records]
