"""Request validation and wire types (clef_local.runtime.schema)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from clef_local.errors import ApiUsageError, ClefError, LimitExceededError, RequestValidationError
from clef_local.runtime.schema import (
    DEFAULT_LIMITS,
    Limits,
    LimitValidationError,
    ModelsResponse,
    Question,
    SystemOneRequest,
    SystemOneResponse,
    validate_request,
)

NOUL = {"type": "noul", "instructions": "Does the customer want a refund?"}
CHOICE = {
    "type": "choice",
    "instructions": "Which team?",
    "criteria": {"Technical": "Bugs", "Billing": "Payments", "Sales": None},
}
SCORE = {"type": "score", "instructions": "How frustrated?", "criteria": ["Calm", "Annoyed", "Very angry"]}


def body(questions: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    return {
        "model": "clef",
        "state": "I was charged twice.",
        "questions": questions or {"q1": dict(NOUL)},
        **top,
    }


def q1(question: dict[str, Any]) -> dict[str, Any]:
    return body({"q1": question})


def without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


STRUCTURAL = [
    # (case, body, expected loc, words the message must contain)
    ("missing-state", without(body(), "state"), ["body", "state"], ["state", "required"]),
    ("missing-model", without(body(), "model"), ["body", "model"], ["model", "required"]),
    ("missing-questions", without(body(), "questions"), ["body", "questions"], ["questions", "required"]),
    ("empty-questions", {**body(), "questions": {}}, ["body", "questions"], ["questions", "at least one"]),
    ("questions-array", {**body(), "questions": [NOUL]}, ["body", "questions"], ["questions", "array"]),
    (
        "unknown-type",
        q1({"type": "boolean"}),
        ["body", "questions", "q1", "type"],
        ["'q1'", "type", "noul", "choice", "score"],
    ),
    (
        "missing-type",
        q1({"instructions": "x"}),
        ["body", "questions", "q1", "type"],
        ["'q1'", "type", "required"],
    ),
    ("question-not-object", q1("noul"), ["body", "questions", "q1"], ["'q1'", "object"]),  # type: ignore[arg-type]
    (
        "choice-1-option",
        q1({"type": "choice", "criteria": {"Billing": None}}),
        ["body", "questions", "q1", "criteria"],
        ["question 'q1': choice criteria need at least 2 labels, got 1"],
    ),
    (
        "choice-0-options",
        q1({"type": "choice", "criteria": {}}),
        ["body", "questions", "q1", "criteria"],
        ["'q1'", "at least 2", "got 0"],
    ),
    (
        "choice-missing-criteria",
        q1({"type": "choice"}),
        ["body", "questions", "q1", "criteria"],
        ["'q1'", "choice criteria", "required"],
    ),
    (
        "choice-array-criteria",
        q1({"type": "choice", "criteria": ["a", "b"]}),
        ["body", "questions", "q1", "criteria"],
        ["'q1'", "choice criteria", "object", "array"],
    ),
    (
        "choice-number-description",
        q1({"type": "choice", "criteria": {"a": 1, "b": None}}),
        ["body", "questions", "q1", "criteria"],
        ["'q1'", "'a'", "number"],
    ),
    (
        "score-1-level",
        q1({"type": "score", "criteria": ["Calm"]}),
        ["body", "questions", "q1", "criteria"],
        ["'q1'", "at least 2 levels", "got 1"],
    ),
    (
        "score-map",
        q1({"type": "score", "criteria": {"0": "Calm", "1": "Angry"}}),
        ["body", "questions", "q1", "criteria"],
        ["'q1'", "score criteria must be an array of level texts", "map-form criteria", "not supported"],
    ),
    (
        "score-missing-criteria",
        q1({"type": "score"}),
        ["body", "questions", "q1", "criteria"],
        ["'q1'", "score criteria", "required"],
    ),
    (
        "score-null-level",
        q1({"type": "score", "criteria": ["Calm", None]}),
        ["body", "questions", "q1", "criteria"],
        ["'q1'", "level 1", "null"],
    ),
    ("model-number", body(model=123), ["body", "model"], ["model", "string"]),
    ("state-number", body(state=3), ["body", "state"], ["state", "string, object or array", "number"]),
    ("state-bool", body(state=True), ["body", "state"], ["state", "boolean"]),
    ("state-null", body(state=None), ["body", "state"], ["state", "null"]),
    ("empty-question-id", body({"": dict(NOUL)}), ["body", "questions"], ["question ids", "non-empty"]),
    (
        "noul-unknown-key",
        q1({"type": "noul", "criteria": {"true": "yes", "maybe": "?"}}),
        ["body", "questions", "q1", "criteria"],
        ["'q1'", "'true'", "'false'", "maybe"],
    ),
    (
        "noul-array-criteria",
        q1({"type": "noul", "criteria": ["yes", "no"]}),
        ["body", "questions", "q1", "criteria"],
        ["'q1'", "noul criteria", "array"],
    ),
    (
        "instructions-number",
        q1({"type": "noul", "instructions": 5}),
        ["body", "questions", "q1", "instructions"],
        ["'q1'", "instructions", "number"],
    ),
    ("images-string", body(images="x.png"), ["body", "images"], ["images"]),
]

LIMITS = [
    # (case, body, expected loc, words the message must contain)
    (
        "choice-256-options",
        q1({"type": "choice", "criteria": {f"Queue {i:03d}": None for i in range(256)}}),
        ["body", "questions", "q1", "criteria"],
        ["'q1'", "256", "255", "max_choice_options"],
    ),
    (
        "score-11-levels",
        q1({"type": "score", "criteria": [f"Level {i}" for i in range(11)]}),
        ["body", "questions", "q1", "criteria"],
        ["'q1'", "11", "10", "max_score_levels"],
    ),
    (
        "65-questions",
        body({f"q{i}": dict(NOUL) for i in range(65)}),
        ["body", "questions"],
        ["65 questions", "64", "max_questions"],
    ),
]


def _check_errors(exc: RequestValidationError, loc: list[Any], words: list[str]) -> None:
    assert exc.errors, "no errors reported"
    json.dumps(exc.errors)  # served as-is in the 422 body
    for e in exc.errors:
        assert set(e) == {"loc", "msg", "type"}
        assert e["loc"][0] == "body"
        assert isinstance(e["msg"], str) and isinstance(e["type"], str)
    matching = [e for e in exc.errors if e["loc"] == loc]
    assert matching, f"no error at {loc}: {exc.errors}"
    for word in words:
        assert word in matching[0]["msg"], f"{word!r} not in {matching[0]['msg']!r}"
        assert word in str(exc)


@pytest.mark.parametrize(("case", "data", "loc", "words"), STRUCTURAL, ids=[c[0] for c in STRUCTURAL])
def test_structural_errors(case: str, data: Any, loc: list[Any], words: list[str]) -> None:
    with pytest.raises(RequestValidationError) as info:
        validate_request(data)
    assert not isinstance(info.value, LimitExceededError)
    assert info.value.status_code == 422
    _check_errors(info.value, loc, words)


@pytest.mark.parametrize(("case", "data", "loc", "words"), LIMITS, ids=[c[0] for c in LIMITS])
def test_limit_errors(case: str, data: Any, loc: list[Any], words: list[str]) -> None:
    with pytest.raises(LimitExceededError) as info:
        validate_request(data)
    exc = info.value
    assert isinstance(exc, LimitValidationError) and isinstance(exc, RequestValidationError)
    assert isinstance(exc, ApiUsageError)
    # jevcompat checks every rejected body for 422 with detail[], limits included.
    assert exc.status_code == 422
    assert exc.to_detail() == exc.errors
    _check_errors(exc, loc, words)


@pytest.mark.parametrize("data", [None, [], "text", 3, [body()]])
def test_body_not_an_object(data: Any) -> None:
    with pytest.raises(RequestValidationError) as info:
        validate_request(data)
    assert info.value.errors[0]["loc"] == ["body"]
    assert "JSON object" in info.value.errors[0]["msg"]


def test_structural_problem_with_a_limit_problem_is_not_a_limit_error() -> None:
    data = q1({"type": "score", "criteria": [str(i) for i in range(11)]}) | {"model": 1}
    with pytest.raises(RequestValidationError) as info:
        validate_request(data)
    assert not isinstance(info.value, LimitExceededError)
    assert {tuple(e["loc"]) for e in info.value.errors} == {
        ("body", "model"),
        ("body", "questions", "q1", "criteria"),
    }


def test_every_question_is_reported() -> None:
    with pytest.raises(RequestValidationError) as info:
        validate_request(body({"a": {"type": "x"}, "b": {"type": "choice", "criteria": {"only": None}}}))
    locs = [e["loc"] for e in info.value.errors]
    assert ["body", "questions", "a", "type"] in locs
    assert ["body", "questions", "b", "criteria"] in locs


def test_no_pydantic_exception_leaks() -> None:
    weird: list[Any] = [
        {"model": "m", "state": "s", "questions": {1: NOUL}},
        body({"q": {"type": None}}),
        body({"q": {"type": "noul", "criteria": "yes"}}),
        {"state": object()},
    ]
    for data in weird:
        with pytest.raises(RequestValidationError) as info:
            validate_request(data)
        assert not isinstance(info.value, ValidationError)
        assert isinstance(info.value, ClefError)


def test_braces_in_user_text_are_not_a_template() -> None:
    with pytest.raises(RequestValidationError) as info:
        validate_request(q1({"type": "noul", "criteria": {"{detail}": "x"}}))
    assert "{detail}" in info.value.errors[0]["msg"]


# ---------------------------------------------------------------- valid requests


@pytest.mark.parametrize(
    "criteria",
    [
        None,
        {},
        {"true": "yes"},
        {"false": None},
        {"true": "y", "false": "n"},
        {"true": {"examples": ["refund me"]}, "false": ["questions"]},
    ],
)
def test_valid_noul(criteria: Any) -> None:
    req = validate_request(q1({**NOUL, "criteria": criteria}))
    assert req.questions["q1"].type == "noul"
    assert req.questions["q1"].criteria == criteria


def test_valid_noul_without_criteria_or_instructions() -> None:
    req = validate_request(q1({"type": "noul"}))
    assert req.questions["q1"].instructions is None
    assert req.questions["q1"].criteria is None


def test_valid_choice_and_score() -> None:
    req = validate_request(body({"team": CHOICE, "anger": SCORE}))
    assert list(req.questions) == ["team", "anger"]
    assert req.questions["team"].criteria == CHOICE["criteria"]
    assert req.questions["anger"].criteria == SCORE["criteria"]


@pytest.mark.parametrize("n", [2, 255])
def test_choice_option_bounds_accepted(n: int) -> None:
    validate_request(q1({"type": "choice", "criteria": {f"o{i}": None for i in range(n)}}))


@pytest.mark.parametrize("n", [2, 10])
def test_score_level_bounds_accepted(n: int) -> None:
    validate_request(q1({"type": "score", "criteria": [f"L{i}" for i in range(n)]}))


def test_64_questions_accepted() -> None:
    assert len(validate_request(body({f"q{i}": dict(NOUL) for i in range(64)})).questions) == 64


@pytest.mark.parametrize("state", ["text", {"subject": "x", "n": [1, 2]}, ["a", "b"], ""])
def test_state_shapes(state: Any) -> None:
    assert validate_request(body(state=state)).state == state


def test_structured_text_everywhere() -> None:
    # jevcompat request.structured-text (MUST): instructions, descriptions and levels may be objects/arrays.
    req = validate_request(
        body(
            {
                "n": {
                    "type": "noul",
                    "instructions": {"task": "refund?"},
                    "criteria": {"true": {"a": 1}, "false": ["b"]},
                },
                "c": {
                    "type": "choice",
                    "instructions": ["Route.", "One team."],
                    "criteria": {
                        "Billing": {"owns": ["invoices"]},
                        "Technical": ["bugs"],
                        "Sales": "Pricing",
                    },
                },
                "s": {
                    "type": "score",
                    "instructions": {"scale": "x"},
                    "criteria": [{"label": "Calm"}, ["Angry"], "Worse"],
                },
            }
        )
    )
    assert req.questions["c"].criteria == {
        "Billing": {"owns": ["invoices"]},
        "Technical": ["bugs"],
        "Sales": "Pricing",
    }


@pytest.mark.parametrize("qid", ["ticket-1", "q.2", "with space", "질문", "🎯", "0"])
def test_any_non_empty_question_id(qid: str) -> None:
    assert list(validate_request(body({qid: NOUL})).questions) == [qid]


def test_unknown_top_level_fields_ignored() -> None:
    req = validate_request(body(x_trace_id="abc", seed=7, temperature=0.2))
    assert "x_trace_id" not in req.model_dump()
    assert "seed" not in req.model_dump()


def test_unknown_question_fields_ignored() -> None:
    assert validate_request(q1({**NOUL, "weight": 2})).questions["q1"].type == "noul"


def test_media_and_assets_kept() -> None:
    req = validate_request(body(images=["data:image/png;base64,AA"], videos=[], assets={"k": 1}))
    assert req.images == ["data:image/png;base64,AA"] and req.videos == [] and req.assets == {"k": 1}


# ---------------------------------------------------------------- the validated request


def test_the_validated_request_keeps_request_order() -> None:
    """Question and choice-label order is request order (the encoder sorts options itself; answers list labels in
    request order), and structured criteria stay structured."""
    labels = ["Zulu", "alpha", "Mike", "Échec", "10", "2", "Bravo"]
    criteria = {label: (None if i % 2 else f"about {label}") for i, label in enumerate(labels)}
    req = validate_request(
        body({"z": {"type": "choice", "criteria": criteria}, "a": SCORE, "m": NOUL}, images=["img"], extra=1)
    )
    assert req.model == "clef" and req.state == "I was charged twice."
    assert req.images == ["img"] and req.videos is None
    assert list(req.questions) == ["z", "a", "m"]
    assert list(req.questions["z"].criteria) == labels  # type: ignore[arg-type]
    assert req.questions["z"].criteria == criteria
    assert (req.questions["a"].type, req.questions["a"].instructions, req.questions["a"].criteria) == (
        "score", SCORE["instructions"], SCORE["criteria"])
    assert (req.questions["m"].type, req.questions["m"].criteria) == ("noul", None)


# ---------------------------------------------------------------- limits


def test_default_limits() -> None:
    assert Limits(64, 2, 255, 2, 10) == DEFAULT_LIMITS
    with pytest.raises(AttributeError):
        DEFAULT_LIMITS.max_questions = 1  # type: ignore[misc]


def test_custom_max_questions() -> None:
    limits = Limits(max_questions=2)
    validate_request(body({"a": NOUL, "b": NOUL}), limits)
    with pytest.raises(LimitExceededError, match=r"3 questions.*limit of 2.*max_questions"):
        validate_request(body({"a": NOUL, "b": NOUL, "c": NOUL}), limits)


def test_custom_option_and_level_limits() -> None:
    limits = Limits(min_choice_options=1, max_choice_options=3, min_score_levels=3, max_score_levels=4)
    validate_request(q1({"type": "choice", "criteria": {"only": None}}), limits)
    with pytest.raises(LimitExceededError, match="limit of 3"):
        validate_request(
            q1({"type": "choice", "criteria": {"a": None, "b": None, "c": None, "d": None}}), limits
        )
    with pytest.raises(RequestValidationError, match="at least 3 levels, got 2"):
        validate_request(q1({"type": "score", "criteria": ["lo", "hi"]}), limits)
    with pytest.raises(LimitExceededError, match="limit of 4"):
        validate_request(q1({"type": "score", "criteria": list("abcde")}), limits)
    # Beyond the defaults when configured so.
    big = Limits(max_choice_options=300, max_score_levels=12, max_questions=100)
    validate_request(q1({"type": "choice", "criteria": {str(i): None for i in range(300)}}), big)
    validate_request(q1({"type": "score", "criteria": [str(i) for i in range(12)]}), big)
    validate_request(body({str(i): NOUL for i in range(100)}), big)


def test_model_validate_without_context_uses_default_limits() -> None:
    with pytest.raises(ValidationError):
        SystemOneRequest.model_validate(q1({"type": "score", "criteria": [str(i) for i in range(11)]}))
    assert Question.model_validate(SCORE).criteria == SCORE["criteria"]


# ---------------------------------------------------------------- responses


def test_response_models() -> None:
    wire = {
        "model": "clef",
        "answers": {
            "n": {"type": "noul", "noul": 0.8},
            "c": {
                "type": "choice",
                "choice": "B",
                "confidence": 0.5,
                "probabilities": {"Z": 0.25, "B": 0.75},
            },
            "s": {
                "type": "score",
                "score": 1.2,
                "confidence": 0.4,
                "legend": {"0": "lo", "1": "mid", "2": "hi"},
                "probabilities": {"0": 0.2, "1": 0.4, "2": 0.4},
            },
        },
        "usage": {"input_tokens": 120, "output_tokens": 0},
    }
    resp = SystemOneResponse.model_validate(wire)
    assert [a.type for a in resp.answers.values()] == ["noul", "choice", "score"]
    assert resp.model_dump() == wire
    assert list(resp.model_dump()["answers"]["c"]["probabilities"]) == ["Z", "B"]
    with pytest.raises(ValidationError):
        SystemOneResponse.model_validate({**wire, "answers": {"n": {"type": "choice", "noul": 0.5}}})
    json.dumps(SystemOneResponse.model_json_schema())


def test_models_response() -> None:
    wire = {"models": [{"name": "clef-flash", "description": "Clef flash", "release_date": "2026-09-24"}]}
    assert ModelsResponse.model_validate(wire).model_dump() == wire
    json.dumps(SystemOneRequest.model_json_schema())
