"""``clef-local ui`` driven through ``gradio_client`` on a tiny release and its int8 variant (no browser).

The app is launched in-process on a free loopback port; the client calls the same functions as the page's
buttons ("Run this JSON" is ``/run``, the drift probe ``/probe``). The schema builder's pure logic, the snippets
(run against a live ``clef-local serve``) and variant discovery are tested directly.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import clef_local
from clef_local.app import schema_builder
from clef_local.app.models import find_variants, scheme_of
from clef_local.app.results import COMPARE_HEADERS, SUMMARY_HEADERS
from clef_local.app.schema_builder import BuilderError, QuestionDraft
from clef_local.app.snippets import curl_snippet, python_snippet
from clef_local.errors import ApiUsageError, RequestValidationError
from clef_local.runtime.schema import validate_request

REQUEST = schema_builder.example_request("triage")  # noul + choice + score


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Qwen3.5 release and its int8 variant as siblings (so the app finds the variant on its own)."""
    from clef_local.export.quantize import quantize_release
    from clef_local.testing import build_tiny_release

    root = tmp_path_factory.mktemp("ui")
    reference = build_tiny_release(root / "tiny", backbone="qwen3_5", seed=3)
    variant = root / "tiny-int8"
    quantize_release(reference, variant, "int8", validate=False, log_summary=False)
    return reference, variant


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def client(releases: tuple[Path, Path]) -> Iterator[Any]:
    from gradio_client import Client

    from clef_local.app.ui import build_app, launch_options

    demo = build_app(releases[0])
    # launched as `clef-local ui` launches it: behind the Host / Origin guard, so every test here goes through it
    demo.queue().launch(server_port=_free_port(), prevent_thread_lock=True, quiet=True, **launch_options())
    try:
        yield Client(demo.local_url, verbose=False)
    finally:
        demo.close()


@pytest.fixture(scope="module")
def models(releases: tuple[Path, Path]) -> tuple[Any, Any]:
    # as the app loads them (app/models.py): the loader's dtype, a state cache sized by the planner
    return tuple(clef_local.load(path, state_cache="auto") for path in releases)


def _run(client: Any, request: Any, model: Path, variant: Path | None = None) -> dict[str, Any]:
    text = request if isinstance(request, str) else json.dumps(request)
    out = client.predict(text, str(model), str(variant) if variant else "", api_name="/run")
    names = ["request_json", "status", "results_html", "summary", "raw_json", "compare_html", "compare", "images"]
    return dict(zip(names, out, strict=True))


def _probabilities(answer: dict[str, Any]) -> dict[str, float]:
    if answer["type"] == "noul":
        return {"true": answer["noul"]}
    return answer["probabilities"]


def test_run_matches_decide(client: Any, releases: tuple[Path, Path], models: tuple[Any, Any]) -> None:
    out = _run(client, REQUEST, releases[0])
    expected = models[0].decide(REQUEST)
    got = json.loads(out["raw_json"])
    assert list(got["answers"]) == ["is_complaint", "category", "urgency"]
    for qid, answer in expected["answers"].items():
        want, have = _probabilities(answer), _probabilities(got["answers"][qid])
        assert list(have) == list(want)
        assert max(abs(have[k] - want[k]) for k in want) < 1e-6, qid
    assert got["usage"] == expected["usage"]
    assert f"{expected['usage']['input_tokens']} input tokens" in out["status"]
    # the summary table and the bars say the same thing
    assert out["summary"]["headers"] == SUMMARY_HEADERS
    rows = {row[0]: row for row in out["summary"]["data"]}
    assert rows["category"][2] == expected["answers"]["category"]["choice"]
    assert rows["urgency"][5] == pytest.approx(expected["answers"]["urgency"]["score"], abs=1e-4)
    assert out["results_html"].count('class="clef-bar"') == 2 + 4 + 4
    assert out["compare"]["data"] == []  # no variant chosen


def _api_messages(request: Any) -> list[str]:
    with pytest.raises(RequestValidationError) as info:
        validate_request(request)
    return [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in info.value.errors]


def test_invalid_schema_returns_the_validation_message(client: Any, releases: tuple[Path, Path]) -> None:
    bad = json.loads(json.dumps(REQUEST))
    bad["questions"]["category"]["criteria"] = {"only": None}
    bad["questions"]["urgency"]["criteria"] = {"0": "low", "1": "high"}
    messages = _api_messages(bad)
    assert len(messages) == 2
    out = _run(client, bad, releases[0])
    for message in messages:
        assert message in out["status"]
    assert "422" in out["status"] and out["raw_json"] == "" and out["results_html"] == ""
    not_json = _run(client, '{"model": "x", "state": ', releases[0])
    assert "JSON decode error" in not_json["status"] and "Traceback" not in not_json["status"]


def test_compare_returns_delta_p_per_question(client: Any, releases: tuple[Path, Path],
                                              models: tuple[Any, Any]) -> None:
    out = _run(client, REQUEST, releases[0], releases[1])
    assert out["compare"]["headers"] == COMPARE_HEADERS
    rows = {row[0]: dict(zip(COMPARE_HEADERS, row, strict=True)) for row in out["compare"]["data"]}
    assert list(rows) == list(REQUEST["questions"])
    ref, var = (m.predict([REQUEST])[0] for m in models)
    for question, p, q in zip(ref.encoded.questions, ref.probabilities, var.probabilities, strict=True):
        row = rows[question.question_id]
        assert float(row["max |Δp|"]) == pytest.approx(float(np.abs(p - q).max()), abs=1e-6)
        assert float(row["KL(ref‖var)"]) >= 0.0
        assert (row["flipped"] == "FLIPPED") == (int(np.argmax(p)) != int(np.argmax(q)))
    both = json.loads(out["raw_json"])
    assert set(both) == {"reference", "variant"}
    assert out["compare_html"].count("clef-bar-var") == 2 + 4 + 4


def test_drift_probe_writes_a_report(client: Any, releases: tuple[Path, Path]) -> None:
    summary, report = client.predict(str(releases[0]), str(releases[1]), api_name="/probe")
    assert "Drift probe" in summary and "questions" in summary
    text = Path(report).read_text(encoding="utf-8")
    assert "<html" in text.lower() and releases[1].name in text
    no_variant, none = client.predict(str(releases[0]), "", api_name="/probe")
    assert "Choose a variant" in no_variant and none is None


def test_import_request_json(client: Any) -> None:
    moderation = schema_builder.example_request("moderation")
    mode, state, status = client.predict(json.dumps(moderation), api_name="/import")
    assert mode == "JSON" and json.loads(state) == moderation["state"] and "Imported 2 questions" in status
    empty = {"model": "m", "state": "s", "questions": {}}
    *_, status = client.predict(json.dumps(empty), api_name="/import")
    assert _api_messages(empty)[0] in status


def test_images_run_through_the_page(client: Any, releases: tuple[Path, Path], models: tuple[Any, Any],
                                     tiny_llama: Path) -> None:
    from media_gen import data_uri, image

    from clef_local.app.models import media_note

    assert models[0].describe()["vision_tower"]  # the tiny Qwen3.5 release carries a vision tower
    assert "Drop images here" in media_note(models[0]) and "<image 1>" in media_note(models[0])
    request = {**REQUEST, "images": [data_uri(image(80, 60, seed=1)), data_uri(image(50, 90, seed=2))]}
    out = _run(client, request, releases[0])
    assert "2 images" in out["status"], out["status"]
    assert json.loads(out["raw_json"]) == json.loads(json.dumps(models[0].decide(request)))
    assert [caption for *_, caption in ((i["image"], i["caption"]) for i in out["images"])] == ["<image 1>",
                                                                                             "<image 2>"]
    bad = _run(client, {**REQUEST, "images": ["https://example.com/x.png"]}, releases[0])
    assert "does not fetch URLs" in bad["status"] and not bad["images"]
    with pytest.raises(ApiUsageError, match="has no vision tower"):
        clef_local.load(tiny_llama).decide({**REQUEST, "images": [data_uri(image(8, 8))]})
    assert media_note(clef_local.load(tiny_llama)).startswith("Images are not accepted by this model: none")


def test_variants_are_found_beside_the_model(releases: tuple[Path, Path]) -> None:
    assert find_variants(releases[0]) == [releases[1]]
    assert scheme_of(releases[1]) == "int8" and scheme_of(releases[0]) is None


# ---------------------------------------------------------------- the builder's logic


@pytest.mark.parametrize("name", list(schema_builder.EXAMPLES))
def test_examples_round_trip_through_the_builder(name: str) -> None:
    request = schema_builder.example_request(name)
    drafts, mode, state = schema_builder.request_to_drafts(request)
    assert schema_builder.build_request(drafts, mode, state) == request


def test_tricky_values_round_trip() -> None:
    request = {"model": "clef-local", "state": ["a", {"b": 1}], "questions": {
        "q": {"type": "choice", "instructions": {"ask": "which?"}, "criteria": {
            "time: morning": "has the separator", " padded": None, "json-ish": {"x": [1, 2]}, "[x]": "bracket",
            "empty": "", "plain": "text: with colon"}},
        "s": {"type": "score", "instructions": "", "criteria": ['"quoted"', "null", {"level": 2}, " lead"]},
        "n": {"type": "noul", "criteria": {"true": None, "false": "null"}},
        "m": {"type": "noul", "instructions": "[urgent] is it?"},
    }}
    drafts, mode, state = schema_builder.request_to_drafts(request)
    assert mode == "JSON"
    assert schema_builder.build_request(drafts, mode, state) == request


def test_builder_edits_and_messages() -> None:
    drafts = [QuestionDraft("a", "choice", "Pick", "x: first\ny\nz: third")]
    drafts = [*drafts, schema_builder.new_draft(drafts)]
    assert drafts[1].id == "q2"
    assert [d.id for d in schema_builder.move(drafts, 1, -1)] == ["q2", "a"]
    assert schema_builder.move(drafts, 0, -1) == drafts
    assert [d.id for d in schema_builder.remove(drafts, 0)] == ["q2"]
    request = schema_builder.build_request(drafts[:1], "text", "hello")
    assert request["questions"]["a"]["criteria"] == {"x": "first", "y": None, "z": "third"}
    # a new question has no options yet: the API's own message says so
    assert schema_builder.validation_messages(schema_builder.build_request(drafts, "text", "hi")) == \
        _api_messages(schema_builder.build_request(drafts, "text", "hi"))
    with pytest.raises(BuilderError) as info:
        schema_builder.build_request([drafts[0], drafts[0]], "JSON", "{not json")
    assert any("reuses the id of question 1" in m for m in info.value.messages)
    assert any(m.startswith("body.state: not valid JSON") for m in info.value.messages)
    values = [v for d in drafts for v in d.fields()]
    assert schema_builder.drafts_from_values(values) == drafts


# ---------------------------------------------------------------- snippets against a live `clef-local serve`


@pytest.fixture(scope="module")
def served(models: tuple[Any, Any]) -> Iterator[str]:
    from clef_local.server import ServerConfig, ThreadedServer, create_app

    with ThreadedServer(create_app({"clef-local": models[0]}, ServerConfig())) as running:
        yield running.url


def _rounded_answers(model: Any, request: dict[str, Any]) -> dict[str, Any]:
    from clef_local.runtime.answers import round_floats

    return round_floats(model.decide(request), 4)["answers"]


def test_curl_snippet_runs(served: str, models: tuple[Any, Any]) -> None:
    done = subprocess.run(["bash", "-c", curl_snippet(REQUEST, served)], capture_output=True, text=True,
                          timeout=120, check=True)
    assert json.loads(done.stdout)["answers"] == _rounded_answers(models[0], REQUEST)


def test_python_snippet_runs_with_typesafe_sdk(served: str, models: tuple[Any, Any]) -> None:
    done = subprocess.run([sys.executable, "-c", python_snippet(REQUEST, served)], capture_output=True, text=True,
                          timeout=120, check=True)
    answers = json.loads(done.stdout)["answers"]
    expected = _rounded_answers(models[0], REQUEST)
    assert answers["is_complaint"]["noul"] == expected["is_complaint"]["noul"]
    assert answers["category"]["probabilities"] == expected["category"]["probabilities"]
    assert answers["urgency"]["score"] == expected["urgency"]["score"]


def test_score_decision_names_its_level() -> None:
    """A score question's decision is its mode level, shown with the level's text (not the bare index)."""
    from clef_local.app.results import results_html

    response = {"answers": {"urgency": {"type": "score", "score": 1.2, "confidence": 0.5,
                                        "legend": {"0": "low", "1": "medium", "2": "high"},
                                        "probabilities": {"0": 0.1, "1": 0.6, "2": 0.3}}}}
    html = results_html(response)
    assert '<b class="clef-decision">1 · medium</b>' in html
    assert '<b class="clef-score">1.200</b>' in html


def test_foreign_host_and_cross_origin_posts_are_refused(client: Any) -> None:
    """DNS rebinding (a foreign Host) gets 400 on every route; a POST from another page's Origin 403, before
    Gradio runs it; the page's own origin and clients without an Origin (gradio_client, above) pass."""
    import httpx

    base = client.src.rstrip("/")
    port = int(base.rsplit(":", 1)[1])
    with httpx.Client(base_url=base, timeout=30) as http:
        for path in ("/", "/config", "/gradio_api/info"):
            page = http.get(path, headers={"host": f"evil.example:{port}"})
            assert page.status_code == 400 and page.json()["detail"]["error_type"] == "invalid_host", path
            assert http.get(path).status_code == 200, path
        join = {"data": ["{}", "", ""], "fn_index": 0, "session_hash": "x1", "event_data": None, "trigger_id": None}
        for origin in ("http://evil.example", "null", "http://localhost:1"):
            for path, kwargs in (("/gradio_api/queue/join", {"json": join}),
                                 ("/gradio_api/upload", {"files": {"files": ("a.json", b"{}")}}),
                                 ("/gradio_api/run/predict", {"content": b"{}"})):
                refused = http.post(path, headers={"origin": origin}, **kwargs)  # type: ignore[arg-type]
                assert refused.status_code == 403, (origin, path, refused.status_code)
                assert refused.json()["detail"]["error_type"] == "forbidden_origin"
            # (Gradio's own CORS layer still lets localhost pages read the 403; nobody else can)
            assert "access-control-allow-origin" not in refused.headers or origin.startswith("http://localhost")
        own = http.post("/gradio_api/upload", headers={"origin": base}, files={"files": ("a.json", b"{}")})
        assert own.status_code == 200, own.text


def test_launch_options_keep_the_app_local() -> None:
    from clef_local.app.ui import launch_options

    options = launch_options("127.0.0.1", ["my-box.local"])
    assert options["share"] is False and options["strict_cors"] is True and options["server_name"] == "127.0.0.1"
    guard = options["app_kwargs"]["middleware"][0]
    assert guard.kwargs["hosts"] == {"localhost", "127.0.0.1", "[::1]", "my-box.local"}
