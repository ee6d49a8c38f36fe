"""``clef-local mcp`` over stdio, driven by the MCP SDK's own client as a desktop agent host drives it (the server a
subprocess, two tiny releases): the tools and their schemas, every answer against ``clef_local.load(...).decide``,
``ask_again`` through the state cache, and bad arguments as tool errors naming the field as the HTTP 4xx does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp_client import QUESTIONS, ROOT, STATE, McpSession, close, digest_of, stdio_parameters

import clef_local
from clef_local.mcp.tools import inline_schema
from clef_local.runtime.answers import round_floats
from clef_local.runtime.schema import Question, SystemOneRequest, SystemOneResponse
from clef_local.server import ServerConfig, ThreadedServer, create_app

TOOLS = ["decide", "ask_yes_no", "choose", "rate", "ask_again", "models"]


@pytest.fixture(scope="module")
def qwen(tiny_qwen: Path) -> Any:
    return clef_local.load(tiny_qwen, dtype="float32", state_cache=0)


@pytest.fixture(scope="module")
def llama(tiny_llama: Path) -> Any:
    return clef_local.load(tiny_llama, dtype="float32", state_cache=0)


@pytest.fixture(scope="module")
def session(tiny_qwen: Path, tiny_llama: Path) -> Iterator[McpSession]:
    """The real command, launched as a host launches it: two models, float32, a state cache."""
    params = stdio_parameters(["--model", f"clef-local={tiny_qwen}", "--model", f"llama={tiny_llama}",
                               "--dtype", "float32", "--state-cache", "64MiB"])
    with McpSession(params) as running:
        yield running


def _tool(session: McpSession, name: str) -> Any:
    return next(t for t in session.tools() if t.name == name)


def test_the_tools_and_their_schemas_come_from_the_request_model(session: McpSession) -> None:
    tools = session.tools()
    assert [t.name for t in tools] == TOOLS
    assert all(t.annotations.read_only_hint and not t.annotations.open_world_hint for t in tools)
    request, question = inline_schema(SystemOneRequest), inline_schema(Question)
    decide = _tool(session, "decide").input_schema
    assert set(decide["properties"]) == set(request["properties"])
    assert decide["properties"]["state"] == request["properties"]["state"]
    assert decide["properties"]["questions"]["additionalProperties"] == question
    assert decide["required"] == ["state", "questions"]  # model defaults to the first --model
    assert decide["properties"]["model"]["enum"] == ["clef-local", "llama"]
    criteria = question["properties"]["criteria"]["anyOf"]
    choose, rate = _tool(session, "choose").input_schema, _tool(session, "rate").input_schema
    assert choose["properties"]["options"]["additionalProperties"] == criteria[0]["additionalProperties"]
    assert choose["properties"]["options"]["minProperties"] == 2
    assert rate["properties"]["levels"]["items"] == criteria[1]["items"]
    assert rate["properties"]["levels"]["maxItems"] == 10
    assert _tool(session, "ask_yes_no").input_schema["required"] == ["state", "question"]
    again = _tool(session, "ask_again").input_schema
    assert again["properties"]["questions"] == decide["properties"]["questions"]
    assert again["properties"]["state"]["pattern"] == "^[0-9a-f]{64}$"
    for name in TOOLS[:5]:
        assert _tool(session, name).output_schema == inline_schema(SystemOneResponse)


def test_decide_and_the_typed_tools_answer_as_decide(session: McpSession, qwen: Any, llama: Any) -> None:
    result = session.call("decide", {"state": STATE, "questions": QUESTIONS})
    assert not result.is_error, result.content[0].text
    want = round_floats(qwen.decide({"model": "clef-local", "state": STATE, "questions": QUESTIONS}), 4)
    close(result.structured_content, want)
    assert json.loads(result.content[0].text) == result.structured_content
    # the digest names this state of this model: the one the same model computes here, whatever the questions
    digest = digest_of(result)
    alone = qwen.encode({"model": "m", "state": STATE, "questions": {"q": {"type": "noul"}}})
    assert digest == qwen.state_digest(alone)
    other = session.call("decide", {"model": "llama", "state": STATE, "questions": QUESTIONS})
    close(other.structured_content, round_floats(llama.decide({"model": "llama", "state": STATE,
                                                               "questions": QUESTIONS}), 4))
    assert digest_of(other) != digest  # another model: another state
    cases = [
        ("ask_yes_no", {"question": "Is this about a card?", "criteria": {"true": "it is a card payment"}},
         {"type": "noul", "instructions": "Is this about a card?", "criteria": {"true": "it is a card payment"}}),
        ("choose", {"question": "Which team?", "options": {"cards": "Card payments", "fraud": None, "loans": None}},
         {"type": "choice", "instructions": "Which team?",
          "criteria": {"cards": "Card payments", "fraud": None, "loans": None}}),
        ("rate", {"levels": ["calm", "annoyed", "furious"]},
         {"type": "score", "instructions": None, "criteria": ["calm", "annoyed", "furious"]}),
    ]
    for tool, args, question in cases:
        got = session.call(tool, {"state": STATE, **args})
        assert not got.is_error, got.content[0].text
        close(got.structured_content, round_floats(qwen.decide({"model": "clef-local", "state": STATE,
                                                                 "questions": {"answer": question}}), 4), where=tool)
        assert digest_of(got) == digest


def test_ask_again_reuses_the_state_sent_before(session: McpSession, qwen: Any) -> None:
    state = "The parcel arrived opened and two of the three items are missing. " * 6
    first = session.call("ask_yes_no", {"state": state, "question": "Is something missing?"})
    digest = digest_of(first)
    before = _cache(session)
    again = session.call("ask_again", {"state": digest, "questions": QUESTIONS})
    assert not again.is_error, again.content[0].text
    close(again.structured_content, round_floats(qwen.decide({"model": "clef-local", "state": state,
                                                               "questions": QUESTIONS}), 4))
    assert digest_of(again) == digest
    after = _cache(session)
    assert after["hits"] == before["hits"] + 1 and after["misses"] == before["misses"]  # the state did not run again


def _cache(session: McpSession) -> dict[str, Any]:
    listing = session.call("models").structured_content
    assert listing["default"] == "clef-local" and [m["name"] for m in listing["models"]] == ["clef-local", "llama"]
    return dict(listing["models"][0]["state_cache"])


def test_models_says_what_is_loaded(session: McpSession, qwen: Any) -> None:
    listing = session.call("models").structured_content
    first = listing["models"][0]
    assert first["context_tokens"] == qwen.max_length and first["path"] == str(qwen.path)
    assert first["question_types"] == ["noul", "choice", "score"] and first["limits"]["max_questions"] == 64
    assert first["image_formats"] == ["PNG", "JPEG", "WEBP", "GIF", "BMP"] and first["media"]["images"] == "accepted"
    text_only = listing["models"][1]  # the tiny Llama has no vision tower
    assert text_only["image_formats"] == [] and "no vision tower" in text_only["media"]
    assert first["state_cache"]["budget"] == 64 * 1024 * 1024 and first["weights"]["dtype"] == "float32"
    assert listing["remembered_states"]["budget"] == "64.0 MiB"


BAD = [  # (tool, arguments, the field the error names, a phrase of its message)
    ("decide", {"state": STATE, "questions": {"team": {"type": "choice", "criteria": {"cards": None}}}},
     "questions.team.criteria", "at least 2 labels"),
    ("decide", {"state": 42, "questions": QUESTIONS}, "state", "must be a string, object or array"),
    ("decide", {"state": STATE, "questions": {"q": {"type": "box"}}}, "questions.q.type", "not supported"),
    ("decide", {"state": STATE, "questions": QUESTIONS, "model": "nope"}, "model", "not served here"),
    ("choose", {"state": STATE, "options": {"only": None}}, "options", "at least 2 labels"),
    ("ask_yes_no", {"state": STATE}, "question", "question is required"),
    ("ask_yes_no", {"state": STATE, "question": "Refund?", "criteria": {"maybe": "x"}}, "criteria", "only the keys"),
    ("ask_yes_no", {"state": STATE, "question": "Refund?", "questoin": "typo"}, "questoin", "not an argument"),
    ("rate", {"state": STATE, "levels": "low, high"}, "levels", "array of level texts"),
    ("rate", {"state": STATE, "levels": ["a", "b"], "question": 7}, "question", "instructions must be"),
    ("ask_yes_no", {"state": STATE, "question": None}, "question", "question is required"),
    ("models", {"verbose": True}, "verbose", "takes no arguments"),
    ("ask_again", {"state": "abc", "questions": QUESTIONS}, "state", "64-hex-digit digest"),
    ("ask_again", {"state": "0" * 64, "questions": QUESTIONS}, "state", "not known here"),
    ("ask_yes_no", {"state": STATE, "question": "Card?", "images": ["not base64!"]}, "images.0", "base64"),
    ("ask_yes_no", {"state": STATE, "question": "Card?", "images": [{"type": "image", "data": 5}]}, "images.0",
     "an MCP image needs"),
]


@pytest.mark.parametrize(("tool", "arguments", "field", "phrase"), BAD, ids=[f"{b[0]}-{b[2]}" for b in BAD])
def test_bad_arguments_are_tool_errors_naming_the_field(session: McpSession, tool: str, arguments: dict[str, Any],
                                                        field: str, phrase: str) -> None:
    result = session.call(tool, arguments)
    assert result.is_error
    text = result.content[0].text
    assert "\n" not in text and "Traceback" not in text and phrase in text, text
    error = result.structured_content
    assert field in [e["field"] for e in error["errors"]], error
    assert 400 <= error["status"] < 500


def test_what_the_sdk_client_cannot_send_is_refused_too(qwen: Any, tiny_llama: Path, tmp_path: Path) -> None:
    """``NaN``, lone surrogates, broken and 100,000-deep JSON, sent as raw lines (the SDK's client turns ``NaN`` into
    null and cannot serialize a lone surrogate: its connection dies): each refused, as ``serve``'s body parser
    refuses them, and the server still answers. A lone surrogate that reached an answer would stop the server's own
    writer in the same way, so the tools refuse them too."""
    from clef_local.mcp.server import ClefTools

    tools = ClefTools({"clef-local": qwen})
    for state, phrase in (({"a": float("nan")}, "finite number"), ("\ud800", "lone UTF-16 surrogate")):
        refused = tools.prepare("decide", {"state": state, "questions": QUESTIONS})
        assert not hasattr(refused, "record") and phrase in refused.message and refused.status == 422
    call = '{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"decide","arguments":%s}}'
    lines = [
        json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}),
        '{"jsonrpc":"2.0","method":"notifications/initialized"}',
        call % (2, '{"state":"\\ud800 lone","questions":{"q":{"type":"noul"}}}'),
        call % (3, '{"state":{"a":NaN},"questions":{"q":{"type":"noul"}}}'),
        "this is not JSON at all",
        call % (4, '{"state":' + "[" * 100_000 + "]" * 100_000 + ',"questions":{"q":{"type":"noul"}}}'),
        call % (5, '{"state":"x","questions":{"q":{"type":"choice","criteria":{"\\udfff":null,"b":null}}}}'),
        call % (6, json.dumps({"state": STATE, "questions": QUESTIONS})),
    ]
    command = [sys.executable, "-m", "clef_local.cli", "mcp", "--model", str(tiny_llama), "--dtype", "float32"]
    with (tmp_path / "stderr.txt").open("w") as stderr, subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}) as server:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write("\n".join(lines) + "\n")
        server.stdin.flush()
        replies: dict[Any, Any] = {}
        while 6 not in replies:  # the last call answered (stdin stays open until then: EOF stops the server)
            line = server.stdout.readline()
            assert line, (tmp_path / "stderr.txt").read_text()[-3000:]
            message = json.loads(line)
            replies[message.get("id")] = message
        server.stdin.close()
        assert server.wait(60) == 0
    assert "result" in replies[1] and not replies[6]["result"]["isError"]  # initialized, and the good call answered
    for request_id in (2, 3, 4, 5):  # refused: a tool error, or the SDK's own JSON-RPC error for unparsable JSON
        reply = replies.get(request_id)
        assert reply is None or "error" in reply or reply["result"]["isError"], reply
    # NaN reaches the tools (the SDK's parser reads it) and is refused there; lone surrogates and 100,000 levels the
    # SDK's parser refuses itself, and drops the line (it cannot know its id)
    assert "finite number" in replies[3]["result"]["content"][0]["text"]
    assert "Traceback" not in (tmp_path / "stderr.txt").read_text()


def test_an_image_for_a_text_only_model_is_refused_with_the_reason(session: McpSession, png: str) -> None:
    result = session.call("ask_yes_no", {"model": "llama", "state": STATE, "question": "Card?", "images": [png]})
    assert result.is_error and result.structured_content["status"] == 400
    assert "has no vision tower" in result.content[0].text


@pytest.fixture(scope="module")
def png() -> str:
    import base64
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 40, 40)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def test_validation_errors_carry_the_http_422s_paths_and_messages(session: McpSession, qwen: Any) -> None:
    """The same bad request to ``serve`` and to the ``decide`` tool: the same field paths and messages."""
    bad = {"state": STATE, "questions": {"team": {"type": "choice", "criteria": ["a"]},
                                         "level": {"type": "score", "criteria": {"0": "low"}}, "x": {"type": 3}}}
    with ThreadedServer(create_app({"clef-local": qwen}, ServerConfig())) as server:
        http = httpx.post(server.url + "/v1/systemone", json={"model": "clef-local", **bad}, timeout=60)
    assert http.status_code == 422
    result = session.call("decide", bad)
    assert result.is_error and result.structured_content["status"] == 422
    got = [(e["loc"], e["msg"]) for e in result.structured_content["errors"]]
    assert got == [(d["loc"][1:], d["msg"]) for d in http.json()["detail"]] and len(got) == 3


def test_the_command_line() -> None:
    """``mcp --help`` imports no torch and no SDK; a missing SDK is one line naming the extra."""
    code = ("import sys; from clef_local.cli import main\ntry:\n    main(['mcp', '--help'])\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules and 'mcp' not in sys.modules, 'imported by --help'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--remember" in result.stdout, result.stderr
    code = "import sys; sys.modules['mcp'] = None\nfrom clef_local.cli import main\nsys.exit(main(['mcp']))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == ("error: clef-local mcp needs the MCP SDK, which is not "
                                                      "installed: pip install 'clef-local[mcp]'")
