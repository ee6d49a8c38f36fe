"""Wire types of the SystemOne API (docs/format.md §2, §5) and validation of requests against configurable limits.

``validate_request`` is the only way a request body enters clef-local and never lets a pydantic exception out:
structural problems are :class:`~clef_local.errors.RequestValidationError` (422, FastAPI-shaped), counts over the
:class:`Limits` :class:`LimitValidationError`, also a ``RequestValidationError`` and so served as 422 too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from clef_local.errors import LimitExceededError, RequestValidationError, short


@dataclass(frozen=True)
class Limits:
    """How large a request may be; the server and CLI may pass their own."""

    # Every question is a field in the joint head's sequence and spans the prompt; 64 keeps latency bounded.
    max_questions: int = 64
    # One option leaves nothing to decide, so the softmax would always answer it with certainty.
    min_choice_options: int = 2
    # The documented SystemOne maximum (jevcompat checks that 255 is accepted).
    max_choice_options: int = 255
    # A scale needs two ends for its expected score to mean anything.
    min_score_levels: int = 2
    # The documented SystemOne maximum (jevcompat checks that 10 is accepted).
    max_score_levels: int = 10
    # Ids and labels are names, not text: a few hundred bytes name anything, and a megabyte id is an attack on
    # the tokenizer, refused before it costs anything. (Texts are bounded by the context: RequestEncoder.check_size.)
    max_question_id_bytes: int = 256
    max_label_bytes: int = 256


DEFAULT_LIMITS = Limits()

# Structured text (objects, arrays) is allowed wherever the API takes text; the encoder renders it as JSON.
Text = str | dict[str, Any] | list[Any]
QuestionType = Literal["noul", "choice", "score"]
# The question types in the head's order: row i of its type embedding is QUESTION_TYPES[i] (docs/format.md §4).
QUESTION_TYPES: tuple[QuestionType, ...] = get_args(QuestionType)
TYPE_IDS: dict[str, int] = {name: i for i, name in enumerate(QUESTION_TYPES)}


class LimitValidationError(RequestValidationError, LimitExceededError):
    """A request over the configured :class:`Limits`.

    Served as a 422 validation error (jevcompat requires ``detail[]`` for every rejected body), and still
    catchable as ``LimitExceededError`` by callers that want to suggest raising a limit.
    """


def _json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _fail(error_type: str, detail: str, **ctx: Any) -> PydanticCustomError:
    # The message goes in as a context value, so braces in user text are never read as a template.
    return PydanticCustomError(error_type, "{detail}", {"detail": detail, **ctx})


def _over(what: str, name: str, limits: Limits) -> PydanticCustomError:
    # ctx["limit"] marks the error as a limit error for _convert.
    value = getattr(limits, name)
    return _fail("too_long", f"{what}, more than the limit of {value}; "
                             f"configure Limits({name}=...) to allow more", limit=name)


def _utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _limits(info: ValidationInfo) -> Limits:
    context = info.context or {}
    return context.get("limits", DEFAULT_LIMITS)


def _check_text(value: Any, what: str, *, nullable: bool) -> None:
    if isinstance(value, str | dict | list) or (nullable and value is None):
        return
    allowed = "a string, object, array or null" if nullable else "a string, object or array"
    raise _fail("text_type", f"{what} must be {allowed}, got {_json_type(value)}")


class Question(BaseModel):
    """One question: ``criteria`` is ``{"true"?, "false"?}`` (noul), ``{label: description}`` (choice, key
    order kept) or an array of level texts (score)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    # The descriptions are what an agent reads in an MCP tool's input schema (clef_local.mcp) and /docs shows.
    type: QuestionType = Field(description="noul: a yes/no question (the answer is P(true)); choice: pick one of "
                                           "the criteria's labels; score: a level on the criteria's ordered scale")
    instructions: Text | None = Field(default=None, description="the question, in words (text or JSON)")
    criteria: dict[str, Text | None] | list[Text] | None = Field(
        default=None, validate_default=True,
        description="noul: optional {\"true\": ..., \"false\": ...} descriptions of the two answers; choice "
                    "(required): {label: description or null}, at least two labels; score (required): an array of "
                    "level descriptions, level 0 first, at least two")

    @field_validator("type", mode="before")
    @classmethod
    def _type(cls, value: Any) -> Any:
        if value == "box":  # Jev's image-location question; a Clef head scores options, it locates nothing
            raise _fail("box_unsupported", "box questions (Jev's image-location type) are not supported: Clef "
                                           "answers noul, choice and score questions only")
        return value

    @field_validator("instructions", mode="before")
    @classmethod
    def _instructions(cls, value: Any) -> Any:
        _check_text(value, "instructions", nullable=True)
        return value

    @field_validator("criteria", mode="before")
    @classmethod
    def _criteria(cls, value: Any, info: ValidationInfo) -> Any:
        qtype = info.data.get("type")
        if qtype == "noul":
            _check_noul(value)
        elif qtype == "choice":
            _check_choice(value, _limits(info))
        elif qtype == "score":
            _check_score(value, _limits(info))
        # An invalid type was already reported on its own field; criteria cannot be judged without it.
        return value


def _check_noul(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise _fail("noul_criteria", "noul criteria must be an object with optional 'true' and 'false' "
                                     f"keys, or null; got {_json_type(value)}")
    unknown = [short(k) for k in value if k not in ("true", "false")]
    if unknown:
        raise _fail("noul_criteria", f"noul criteria allow only the keys 'true' and 'false'; got {unknown[:5]!r}")
    for key, description in value.items():
        _check_text(description, f"noul criteria {key!r}", nullable=True)


def _check_choice(value: Any, limits: Limits) -> None:
    if not isinstance(value, dict):
        got = "nothing" if value is None else _json_type(value)
        raise _fail("missing" if value is None else "dict_type",
                    "choice criteria are required: an object mapping each label to a description or null; "
                    f"got {got}")
    n = len(value)
    if n < limits.min_choice_options:
        raise _fail("too_short", f"choice criteria need at least {limits.min_choice_options} labels, got {n}")
    if n > limits.max_choice_options:
        raise _over(f"choice criteria have {n} labels", "max_choice_options", limits)
    for label in value:
        if _utf8_size(label) > limits.max_label_bytes:
            raise _over(f"the choice label {short(label)!r} is {_utf8_size(label):,} bytes", "max_label_bytes",
                        limits)
    for label, description in value.items():
        _check_text(description, f"choice criteria {label!r}", nullable=True)


def _check_score(value: Any, limits: Limits) -> None:
    if isinstance(value, dict):
        raise _fail("list_type", "score criteria must be an array of level texts (level 0 first); "
                                 "map-form criteria such as {\"0\": ...} are not supported")
    if not isinstance(value, list):
        got = "nothing" if value is None else _json_type(value)
        raise _fail("missing" if value is None else "list_type",
                    f"score criteria are required: an array of level texts (level 0 first); got {got}")
    n = len(value)
    if n < limits.min_score_levels:
        raise _fail("too_short", f"score criteria need at least {limits.min_score_levels} levels, got {n}")
    if n > limits.max_score_levels:
        raise _over(f"score criteria have {n} levels", "max_score_levels", limits)
    for i, level in enumerate(value):
        _check_text(level, f"score level {i}", nullable=False)


class SystemOneRequest(BaseModel):
    """The body of ``POST /v1/systemone``; unknown top-level fields are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(description="the served model's name")
    state: Text = Field(description="what the questions are about: text, or JSON (an object or array)")
    questions: dict[str, Question] = Field(description="the schema: question ids mapped to questions, all "
                                                       "answered in one pass")
    images: list[Any] | None = Field(default=None, description="images in the state, each a data URI "
                                                               "(data:image/png;base64,...) or base64")
    videos: list[Any] | None = Field(default=None, description="videos in the state, each an array of frames "
                                                               "(images)")
    assets: Any = Field(default=None, description="Jev SDK assets: images referred to by placeholders in the text")

    @field_validator("state", mode="before")
    @classmethod
    def _state(cls, value: Any) -> Any:
        _check_text(value, "state", nullable=False)
        return value

    @field_validator("questions", mode="before")
    @classmethod
    def _questions(cls, value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, dict):
            raise _fail("dict_type", f"questions must be an object mapping question ids to questions; "
                                     f"got {_json_type(value)}")
        if not value:
            raise _fail("too_short", "questions must contain at least one question")
        limits = _limits(info)
        # Checked before any question is validated, so an oversized request costs nothing.
        if len(value) > limits.max_questions:
            raise _over(f"the request has {len(value)} questions", "max_questions", limits)
        bad = [k for k in value if not isinstance(k, str) or not k]
        if bad:
            raise _fail("question_id", f"question ids must be non-empty strings; got {bad[0]!r}")
        for key in value:
            if _utf8_size(key) > limits.max_question_id_bytes:
                raise _over(f"the question id {short(key)!r} is {_utf8_size(key):,} bytes", "max_question_id_bytes",
                            limits)
        return value


# What each field allows, for pydantic's own messages (ours already say it).
_ALLOWED = {
    "model": "a string",
    "state": "a string, object or array",
    "questions": "an object mapping question ids to questions",
    "type": "one of 'noul', 'choice', 'score'",
    "images": "an array or null",
    "videos": "an array or null",
}


def _message(err: Any) -> str:
    """A message naming the question and field and saying what is allowed."""
    loc = list(err["loc"])
    in_question = len(loc) >= 2 and loc[0] == "questions"
    field = ".".join(str(p) for p in (loc[2:] if in_question else loc))
    prefix = f"question {loc[1]!r}: " if in_question else ""
    if "detail" in (err.get("ctx") or {}):
        return prefix + err["msg"]
    if in_question and not field:
        return prefix + "must be an object with 'type' and optional 'instructions' and 'criteria'"
    allowed = _ALLOWED.get(str(loc[-1])) if loc else None
    if err["type"] == "missing":
        return prefix + f"{field} is required" + (f" ({allowed})" if allowed else "")
    return prefix + f"{field}: {err['msg']}" + (f"; allowed: {allowed}" if allowed else "")


def _convert(exc: ValidationError) -> RequestValidationError:
    """pydantic's errors as FastAPI-style ``errors`` with ``loc`` starting at the body."""
    errors = [{"loc": ["body", *e["loc"]], "msg": _message(e), "type": e["type"]}
              for e in exc.errors(include_url=False)]
    # Only a request whose sole problem is size is a limit error; anything else must be fixed first.
    over_limit = all("limit" in (e.get("ctx") or {}) for e in exc.errors(include_url=False))
    return LimitValidationError(errors) if over_limit and errors else RequestValidationError(errors)


def validate_request(data: Any, limits: Limits = DEFAULT_LIMITS) -> SystemOneRequest:
    """Validate a decoded JSON body against the SystemOne schema and ``limits``.

    Raises :class:`RequestValidationError` for structural problems (wrong types, missing fields, unknown
    question type, too few options or levels, map-form score criteria) and :class:`LimitValidationError`
    (also a ``LimitExceededError``) when the only problems are counts above ``limits``.
    """
    if not isinstance(data, dict):
        raise RequestValidationError([{
            "loc": ["body"], "type": "model_type",
            "msg": "the request body must be a JSON object with model, state and questions; "
                   f"got {_json_type(data)}",
        }])
    try:
        return SystemOneRequest.model_validate(data, context={"limits": limits})
    except ValidationError as exc:
        raise _convert(exc) from None


# ---------------------------------------------------------------- responses


class NoulAnswer(BaseModel):
    """``noul`` is P(true)."""

    type: Literal["noul"] = "noul"
    noul: float


class ChoiceAnswer(BaseModel):
    """``probabilities`` lists the labels in request order; ``choice`` is the most probable."""

    type: Literal["choice"] = "choice"
    choice: str
    confidence: float
    probabilities: dict[str, float]


class ScoreAnswer(BaseModel):
    """``score`` is the expected level; ``legend`` and ``probabilities`` are keyed ``"0"…"n-1"``."""

    type: Literal["score"] = "score"
    score: float
    confidence: float
    legend: dict[str, Text]  # level texts as sent (structured levels stay structured)
    probabilities: dict[str, float]


Answer = Annotated[NoulAnswer | ChoiceAnswer | ScoreAnswer, Field(discriminator="type")]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class SystemOneResponse(BaseModel):
    """The body of a successful ``POST /v1/systemone``."""

    model: str
    answers: dict[str, Answer]
    usage: Usage


class ModelInfo(BaseModel):
    name: str
    description: str
    release_date: str


class ModelsResponse(BaseModel):
    """The body of ``GET /v1/models``."""

    models: list[ModelInfo]
