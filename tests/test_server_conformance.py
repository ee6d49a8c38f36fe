"""Drop-in conformance of ``clef-local serve``: the ``jevcompat`` suite and the official ``typesafe-sdk`` client.

Both run against a live uvicorn server on loopback, serving a tiny random Qwen3.5 release (the architecture of
real Clef releases); jevcompat runs once more against the embedded demo model (slow). jevcompat must report every
MUST passed; the SHOULD count is printed (``pytest -s``) for the README.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import clef_local
from clef_local.runtime.answers import round_floats
from clef_local.server import ServerConfig, ThreadedServer, create_app


def _require(module: str) -> Any:
    """Import a conformance tool; in CI (where the dev extra installs it) a missing one fails instead of skipping."""
    try:
        return __import__(module)
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{module} is not installed (pip install -e '.[dev]'): {exc}")
        pytest.skip(f"{module} is not installed: {exc}")


@pytest.fixture(scope="module")
def qwen(tiny_qwen: Path) -> Any:
    return clef_local.load(tiny_qwen, state_cache="auto")  # as serve loads it


def _jevcompat(url: str, report: Path, key: str | None = None, timeout: int = 300,
               allow_fail: bool = False) -> dict[str, Any]:
    _require("jevcompat")
    command = [str(Path(sys.executable).with_name("jevcompat")), "test", url, "--json", str(report)]
    env = dict(os.environ)
    if key:
        env["CLEF_TEST_KEY"] = key
        command += ["--key-env", "CLEF_TEST_KEY"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    verdict = [line for line in done.stdout.splitlines() if "MUST" in line and "SHOULD" in line and "/" in line]
    print(f"\njevcompat {'with' if key else 'without'} --api-key: {' '.join(verdict)}")
    assert report.is_file(), done.stdout + done.stderr
    result = json.loads(report.read_text())
    failed = [r for r in result["results"] if r["status"] == "fail"]
    assert allow_fail or done.returncode == 0, f"{done.stdout}\n{done.stderr}\nfailed: {failed}"
    return result


@pytest.mark.parametrize("key", [None, "jevcompat-test-key"], ids=["auth-off", "api-key"])
def test_jevcompat_all_must_pass(qwen: Any, tmp_path: Path, key: str | None) -> None:
    app = create_app({"clef-local": qwen}, ServerConfig(api_key=key))
    with ThreadedServer(app) as running:
        result = _jevcompat(running.url, tmp_path / "r.json", key)
    summary = result["summary"]
    assert summary["verdict"] == "conformant"
    assert summary["MUST"]["failed"] == 0 and summary["MUST"]["passed"] == summary["MUST"]["tested"] == 32
    assert summary["SHOULD"]["failed"] == 0
    musts = {r["id"]: r["status"] for r in result["results"] if r["level"] == "MUST"}
    # auth.ignored-when-off is exercised only without a key, auth.bearer only with one
    assert musts["auth.bearer" if key else "auth.ignored-when-off"] == "pass"
    assert not result["inconclusive"]


@pytest.mark.slow
def test_jevcompat_on_the_demo_model(demo_release: Path, tmp_path: Path) -> None:
    """Every protocol MUST passes on a real backbone; only the model-quality ``semantics.*`` checks may fail.

    jevcompat's semantics checks (renaming ids, reordering or adding questions moves no probability by > 0.05) judge
    the head, not the server (the demo head's nouls still move by more than 0.05 in some requests).
    Any other failure is a server bug and fails this test.
    """
    # loaded as serve loads it: jevcompat's robustness checks send one state with many schemas
    app = create_app({"clef-local": clef_local.load(demo_release, state_cache="auto")}, ServerConfig())
    with ThreadedServer(app) as running:
        # a real 135M backbone answers jevcompat's ~80 requests (some with 255 options) in minutes on 2 cores
        result = _jevcompat(running.url, tmp_path / "r.json", timeout=1800, allow_fail=True)
    failed = {r["id"] for r in result["results"] if r["status"] == "fail"}
    print(f"demo model: failed checks {sorted(failed)}")
    assert all(check.startswith("semantics.") for check in failed), failed
    assert result["summary"]["MUST"]["tested"] == 32 and not result["inconclusive"]


# ---------------------------------------------------------------- typesafe-sdk


@pytest.fixture(scope="module")
def sdk_server(qwen: Any) -> Iterator[tuple[ThreadedServer, Any]]:
    app = create_app({"clef-local": qwen}, ServerConfig())
    with ThreadedServer(app) as running:
        yield running, app.state.clef.metrics


@pytest.fixture
def sdk(sdk_server: tuple[ThreadedServer, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    typesafe_sdk = _require("typesafe_sdk")
    monkeypatch.setenv("TYPESAFE_BASE_URL", sdk_server[0].url)
    monkeypatch.setenv("TYPESAFE_API_KEY", "any-key-auth-is-off")
    with typesafe_sdk.TypeSafeClient(timeout=120) as client:
        yield client


def _expected(model: Any, questions: dict[str, Any], state: Any) -> dict[str, Any]:
    return round_floats(model.decide({"model": "clef-local", "state": state, "questions": questions}), 4)["answers"]


def test_sdk_noul(sdk: Any, qwen: Any) -> None:
    from typesafe_sdk import Noul

    response = sdk.system_one(state="I want my money back.", questions={
        "refund": Noul(instructions="Does the customer ask for a refund?"),
        "polite": Noul(criteria={"true": "Polite wording"})})
    expected = _expected(qwen, {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
                                "polite": {"type": "noul", "criteria": {"true": "Polite wording"}}},
                         "I want my money back.")
    assert response.model == "clef-local"  # the SDK sent its default, jev-latest
    assert response.nouls["refund"].noul == expected["refund"]["noul"]
    assert response.nouls["polite"].noul == expected["polite"]["noul"]
    assert response.usage.input_tokens > 0 and response.usage.output_tokens == 0


def test_sdk_choice(sdk: Any, qwen: Any) -> None:
    from typesafe_sdk import Choice

    criteria = {"Billing": "Payments and refunds", "Technical": None, "Sales": {"owns": ["pricing"]}}
    response = sdk.system_one(state={"ticket": "Charged twice"},
                              questions={"team": Choice(instructions="Which team?", criteria=criteria)})
    expected = _expected(qwen, {"team": {"type": "choice", "instructions": "Which team?", "criteria": criteria}},
                         {"ticket": "Charged twice"})["team"]
    answer = response.choices["team"]
    assert answer.choice == expected["choice"]
    assert answer.confidence == expected["confidence"]
    assert dict(answer.probabilities) == expected["probabilities"]


def test_sdk_score(sdk: Any, qwen: Any) -> None:
    from typesafe_sdk import Score

    levels = ["Calm", "Frustrated", "Very angry"]
    response = sdk.system_one(state=["line one", "line two"],
                              questions={"anger": Score(instructions="How angry?", criteria=levels)})
    expected = _expected(qwen, {"anger": {"type": "score", "instructions": "How angry?", "criteria": levels}},
                         ["line one", "line two"])["anger"]
    answer = response.scores["anger"]
    assert answer.score == expected["score"] and answer.confidence == expected["confidence"]
    assert answer.legend == dict(enumerate(levels))
    assert {str(k): v for k, v in answer.probabilities.items()} == expected["probabilities"]


def test_sdk_large_body_is_zstd(sdk: Any, sdk_server: tuple[ThreadedServer, Any], qwen: Any) -> None:
    from typesafe_sdk import Choice, Noul, Score
    from typesafe_sdk._core.compression import COMPRESSORS

    assert "zstd" in COMPRESSORS, "typesafe-sdk[zstd] is needed for this test"
    metrics = sdk_server[1]
    before = metrics.sample("clef_request_bodies_total", encoding="zstd")
    state = "The customer wrote a long message. " * 60  # > 1 KiB: the SDK compresses it
    assert len(state.encode()) > 1024
    queues = {f"Queue {i:03d}": f"Tickets routed to queue {i}" for i in range(40)}
    response = sdk.system_one(state=state, questions={
        "refund": Noul(instructions="Refund?"),
        "queue": Choice(instructions="Which queue?", criteria=queues),
        "anger": Score(instructions="How angry?", criteria=["calm", "annoyed", "angry", "furious"])})
    assert metrics.sample("clef_request_bodies_total", encoding="zstd") == before + 1
    expected = _expected(qwen, {"refund": {"type": "noul", "instructions": "Refund?"},
                                "queue": {"type": "choice", "instructions": "Which queue?", "criteria": queues},
                                "anger": {"type": "score", "instructions": "How angry?",
                                          "criteria": ["calm", "annoyed", "angry", "furious"]}}, state)
    assert response.nouls["refund"].noul == expected["refund"]["noul"]
    assert response.choices["queue"].choice == expected["queue"]["choice"]
    assert response.scores["anger"].score == expected["anger"]["score"]
