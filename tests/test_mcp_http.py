"""``clef-local mcp --http``: the streamable HTTP app on 127.0.0.1 (a free port, in this process so that the state
cache's counters can be read), driven by the MCP SDK's own client: serve's guard (foreign ``Host`` / ``Origin``, the
API key, the body limit), ``ask_again`` through the state cache, images as MCP content blocks and data URIs under
the media limits, and the demo model's answers against ``decide``."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp_client import QUESTIONS, STATE, McpSession, close, digest_of, http_transport

import clef_local
from clef_local.mcp.http import MCP_PATH, create_http_app
from clef_local.mcp.server import ClefTools
from clef_local.runtime.answers import round_floats
from clef_local.runtime.media import MediaLimits
from clef_local.server import ServerConfig, ThreadedServer

KEY = "mcp-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                         "clientInfo": {"name": "test", "version": "0"}}}
STREAMS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}


@pytest.fixture(scope="module")
def llama(tiny_llama: Path) -> Any:
    return clef_local.load(tiny_llama, dtype="float32", state_cache="64MiB")


@pytest.fixture(scope="module")
def vision(tiny_vision: Path) -> Any:
    return clef_local.load(tiny_vision, dtype="float32", state_cache=0, media_limits=MediaLimits(max_images=2))


@pytest.fixture(scope="module")
def server(llama: Any, vision: Any) -> Iterator[ThreadedServer]:
    config = ServerConfig(api_key=KEY)
    app = create_http_app(ClefTools({"clef-local": llama, "vision": vision}, config), config)
    with ThreadedServer(app, config=config, graceful_timeout_s=5) as running:
        yield running


@pytest.fixture(scope="module")
def session(server: ThreadedServer) -> Iterator[McpSession]:
    with McpSession(http_transport(server.url + MCP_PATH, AUTH)) as running:
        yield running


def test_the_guard_refuses_foreign_hosts_and_pages_and_calls_without_the_key(server: ThreadedServer) -> None:
    url = server.url + MCP_PATH
    with httpx.Client(timeout=30) as http:
        ok = http.post(url, json=INITIALIZE, headers={**STREAMS, **AUTH})
        assert ok.status_code == 200, ok.text  # what the refusals below differ from: one header each
        host = http.post(url, json=INITIALIZE, headers={**STREAMS, **AUTH, "host": "evil.example"})
        assert host.status_code == 400 and host.json()["detail"]["error_type"] == "invalid_host"
        origin = http.post(url, json=INITIALIZE, headers={**STREAMS, **AUTH, "origin": "http://evil.example"})
        assert origin.status_code == 403 and origin.json()["detail"]["error_type"] == "forbidden_origin"
        rebinding = http.post(url, json=INITIALIZE, headers={**STREAMS, **AUTH, "host": f"evil.example:{server.port}",
                                                              "origin": f"http://evil.example:{server.port}"})
        assert rebinding.status_code == 400  # DNS rebinding: the page's own origin, but not this server's name
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"}):
            refused = http.post(url, json=INITIALIZE, headers={**STREAMS, **headers})
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            assert refused.json()["detail"]["error_type"] == "authentication_error"
        huge = http.post(url, content=b"[" + b" " * (14 * 1024 * 1024) + b"]", headers={**STREAMS, **AUTH})
        assert huge.status_code == 413  # serve's 13 MiB body limit


def test_ask_again_runs_only_the_new_schema(session: McpSession, llama: Any, tiny_llama: Path) -> None:
    """The second schema about a state hits the state cache (the counter), with the cold pass's numbers."""
    state = " ".join(f"Line {i}: the customer says the order {i} arrived late and damaged." for i in range(40))
    first = session.call("ask_yes_no", {"state": state, "question": "Is the customer angry?"})
    assert not first.is_error, first.content[0].text
    digest = digest_of(first)
    assert digest in llama.state_cache  # the digest is the state cache's key on the torch backend
    before = llama.state_cache.stats()
    again = session.call("ask_again", {"state": digest, "questions": QUESTIONS})
    after = llama.state_cache.stats()
    assert not again.is_error, again.content[0].text
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)
    cold = clef_local.load(tiny_llama, dtype="float32", state_cache=0)
    close(again.structured_content, round_floats(cold.decide({"model": "clef-local", "state": state,
                                                               "questions": QUESTIONS}), 4))
    third = session.call("ask_again", {"state": digest, "questions": {"late": {"type": "noul"}}})
    assert llama.state_cache.stats().hits == after.hits + 1 and digest_of(third) == digest


def _png(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def test_images_as_mcp_content_blocks_and_data_uris(session: McpSession, vision: Any) -> None:
    red, blue = _png((220, 30, 30)), _png((30, 30, 220))
    block = {"type": "image", "data": base64.b64encode(red).decode(), "mimeType": "image/png"}
    uri = "data:image/png;base64," + base64.b64encode(red).decode()
    question = {"type": "noul", "instructions": "Is the picture red?"}
    want = round_floats(vision.decide({"model": "vision", "state": "a photo", "questions": {"answer": question},
                                       "images": [uri]}), 4)
    for image in (block, uri):
        got = session.call("ask_yes_no", {"model": "vision", "state": "a photo", "question": "Is the picture red?",
                                          "images": [image]})
        assert not got.is_error, got.content[0].text
        close(got.structured_content, want)
    other = session.call("ask_yes_no", {"model": "vision", "state": "a photo", "question": "Is the picture red?",
                                        "images": [base64.b64encode(blue).decode()]})
    assert digest_of(other) != digest_of(got)  # the same text with another picture is another state
    again = session.call("ask_again", {"state": digest_of(got), "questions": QUESTIONS})
    close(again.structured_content, round_floats(vision.decide({"model": "vision", "state": "a photo",
                                                                 "questions": QUESTIONS, "images": [uri]}), 4))
    refusals = [
        ([uri, uri, uri], "images", "more than the limit of 2"),
        ([{"type": "image", "data": block["data"], "mimeType": "text/plain"}], "images.0", "text/plain"),
        (["data:image/png;base64," + base64.b64encode(red[:60]).decode()], "images.0", "corrupt or truncated"),
        ([base64.b64encode(b"definitely not an image").decode()], "images.0", "not an image"),
        (["https://example.com/cat.png"], "images.0", "does not fetch URLs"),
    ]
    for images, field, phrase in refusals:
        result = session.call("ask_yes_no", {"model": "vision", "state": "a photo", "question": "Red?",
                                             "images": images})
        assert result.is_error and phrase in result.content[0].text, result.content[0].text
        assert field in [e["field"] for e in result.structured_content["errors"]]


@pytest.mark.slow
def test_the_demo_model_answers_as_decide_and_ask_again_is_faster(demo_release: Path) -> None:
    demo = clef_local.load(demo_release, dtype="float32", state_cache="auto")  # as mcp loads it
    config = ServerConfig()
    app = create_http_app(ClefTools({"clef-local": demo}, config), config)
    request = {"model": "clef-local", "state": STATE, "questions": QUESTIONS}
    cold_model = clef_local.load(demo_release, dtype="float32", state_cache=0)
    want = round_floats(cold_model.decide(request), 4)
    want_one = round_floats(cold_model.decide({**request, "questions": {"answer": {
        "type": "choice", "instructions": None, "criteria": QUESTIONS["team"]["criteria"]}}}), 4)
    long_state = " ".join(f"Message {i}: my card payment {i} was declined twice at the shop and I was still "
                          f"charged, please look into it." for i in range(30))
    other_state = long_state.replace("declined", "refused")  # as long, another state: a cold pass
    with ThreadedServer(app, config=config, graceful_timeout_s=5) as server, \
            McpSession(http_transport(server.url + MCP_PATH)) as session:
        close(session.call("decide", {"state": STATE, "questions": QUESTIONS}).structured_content, want, tol=1e-3)
        got = session.call("choose", {"state": STATE, "options": QUESTIONS["team"]["criteria"]})
        close(got.structured_content, want_one, tol=1e-3)
        digest = digest_of(session.call("ask_yes_no", {"state": long_state, "question": "Was a card declined?"}))
        began = time.perf_counter()
        session.call("ask_yes_no", {"state": other_state, "question": "Was a card declined?"})
        cold = time.perf_counter() - began
        hits = demo.state_cache.stats().hits
        began = time.perf_counter()
        again = session.call("ask_again", {"state": digest, "questions": {"urgent": {"type": "noul"}}})
        warm = time.perf_counter() - began
    assert not again.is_error and demo.state_cache.stats().hits == hits + 1
    print(f"\nthe demo model, a {demo.encode({**request, 'state': long_state}).state_tokens}-token state: cold "
          f"{cold * 1000:.0f} ms, ask_again {warm * 1000:.0f} ms")
    assert warm < cold
