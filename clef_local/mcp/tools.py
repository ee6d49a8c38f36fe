"""The MCP tools of ``clef-local mcp``: their input schemas, generated from the request model
(:class:`~clef_local.runtime.schema.SystemOneRequest`, :class:`~clef_local.runtime.schema.Question`), and their
arguments turned into SystemOne requests, with the map that names a request's field by the tool argument it came
from. No SDK here: plain JSON schemas and dicts (:mod:`clef_local.mcp.server` wraps them).

- ``decide``: a full ``/v1/systemone`` request (``model`` optional: the default model).
- ``ask_yes_no`` / ``choose`` / ``rate``: one question about a state, built as the one-question request
  ``{"questions": {"answer": ...}}``, so the numbers are ``decide``'s on that request.
- ``ask_again``: new questions about a state sent before, named by the digest its answer returned.
- ``models``: what is served.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clef_local.errors import ClefError, RequestValidationError, one_line, short
from clef_local.runtime.schema import DEFAULT_LIMITS, Limits, SystemOneRequest, SystemOneResponse

ANSWER_ID = "answer"  # the question id of the typed tools' one-question requests
DIGEST = re.compile(r"[0-9a-f]{64}")  # ClefModel.state_digest: SHA-256, lower-case hex
MEDIA_FIELDS = ("images", "videos", "assets")  # besides the state, what makes up a state (docs/format.md §7)
MESSAGE_LIMIT = 2000  # characters of an error message: the runtime's messages cut user text already
IMAGE_CONTENT = {  # MCP's image content block, accepted wherever an image is (converted to a data URI)
    "type": "object", "description": "an MCP image content block",
    "properties": {"type": {"const": "image"}, "data": {"type": "string", "description": "base64 image bytes"},
                   "mimeType": {"type": "string", "description": "image/png, image/jpeg, image/webp, ..."}},
    "required": ["type", "data", "mimeType"],
}


@dataclass(frozen=True)
class ToolSpec:
    """One tool as ``tools/list`` shows it."""

    name: str
    title: str
    description: str
    input_schema: dict[str, Any]
    output_schema: dict[str, Any] | None = None


@dataclass(frozen=True)
class Call:
    """A tool call as a SystemOne request body (not validated yet) and how its fields map back to arguments."""

    body: dict[str, Any]
    rename: Callable[[Sequence[Any]], list[Any]] = field(default=lambda loc: list(loc))  # request loc → argument
    strip: str = ""  # the prefix the request's messages put before a question's problems ("question 'answer': ")


@dataclass(frozen=True)
class ToolError:
    """A refused call: the HTTP status and ``error_type`` it would have had, the one-line message, and each problem
    with the argument path it names (``questions.q1.criteria``, ``options``, ``images.0``)."""

    status: int
    error_type: str
    message: str
    errors: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "error_type": self.error_type, "message": self.message,
                **({"errors": self.errors} if self.errors else {})}


# ---------------------------------------------------------------- schemas


def _inline(schema: Any, defs: Mapping[str, Any]) -> Any:
    """``schema`` with every ``#/$defs/`` reference replaced by its definition (some agent hosts do not follow
    ``$ref``), without pydantic's titles or OpenAPI's ``discriminator`` (not JSON Schema; its mapping names defs)."""
    if isinstance(schema, list):
        return [_inline(item, defs) for item in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return _inline({**defs[ref.removeprefix("#/$defs/")], **{k: v for k, v in schema.items() if k != "$ref"}},
                       defs)
    return {key: _inline(value, defs) for key, value in schema.items()
            if key not in ("$defs", "discriminator") and not (key == "title" and isinstance(value, str))}


def inline_schema(model: Any) -> dict[str, Any]:
    """A pydantic model's JSON schema with its definitions inlined."""
    schema = model.model_json_schema()
    return dict(_inline(schema, schema.get("$defs", {})))


@functools.cache
def _request_schema() -> dict[str, Any]:
    return inline_schema(SystemOneRequest)


def request_property(name: str) -> dict[str, Any]:
    """The schema of a top-level request field (a copy)."""
    return copy.deepcopy(_request_schema()["properties"][name])


def question_property(name: str) -> dict[str, Any]:
    """The schema of a question field (a copy)."""
    return copy.deepcopy(_request_schema()["properties"]["questions"]["additionalProperties"]["properties"][name])


def _branch(schema: dict[str, Any], json_type: str) -> dict[str, Any]:
    """The ``anyOf`` branch of ``schema`` with ``type`` ``json_type`` (the criteria of one question type)."""
    return next(dict(b) for b in schema["anyOf"] if b.get("type") == json_type)


def _images_property() -> dict[str, Any]:
    schema = request_property("images")
    array = _branch(schema, "array")
    array["items"] = {"anyOf": [{"type": "string", "description": "a data URI (data:image/png;base64,...) or "
                                                                  "base64"}, IMAGE_CONTENT]}
    return {"anyOf": [array, {"type": "null"}], "default": None,
            "description": f"{schema['description']}, or MCP image content blocks"}


def _model_property(names: Sequence[str]) -> dict[str, Any]:
    schema = request_property("model")
    return {**schema, "enum": list(names), "description": f"{schema['description']} (default {names[0]})"}


def _object(properties: dict[str, Any], required: Sequence[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


def tool_specs(model_names: Sequence[str], limits: Limits = DEFAULT_LIMITS) -> list[ToolSpec]:
    """The tools for a server of ``model_names`` (the first is the default), their schemas bounded by ``limits``."""
    response = inline_schema(SystemOneResponse)
    model, images, state = _model_property(model_names), _images_property(), request_property("state")
    instructions = question_property("instructions")
    criteria = question_property("criteria")
    text = _branch(criteria, "object")["additionalProperties"]  # an option's description: text, JSON or null

    decide = copy.deepcopy(_request_schema())
    decide["properties"]["model"] = model
    decide["properties"]["images"] = images
    decide["properties"]["questions"]["maxProperties"] = limits.max_questions
    decide["required"] = [name for name in decide["required"] if name != "model"]
    yes_no = _object({
        "state": state,
        "question": {"anyOf": [b for b in instructions["anyOf"] if b.get("type") != "null"],
                     "description": "the yes/no question, in words (text or JSON)"},
        "criteria": {"type": "object", "properties": {"true": text, "false": text}, "additionalProperties": False,
                     "description": "what a yes (true) and a no (false) mean, when the question leaves it open"},
        "model": model, "images": images,
    }, ["state", "question"])
    options = {**_branch(criteria, "object"), "minProperties": limits.min_choice_options,
               "maxProperties": limits.max_choice_options,
               "description": "the labels to choose from, each mapped to a description or null (the answer is one "
                              "label, with a probability per label)"}
    choose = _object({"state": state, "question": {**instructions, "description": "what to choose, in words"},
                      "options": options, "model": model, "images": images}, ["state", "options"])
    levels = {**_branch(criteria, "array"), "minItems": limits.min_score_levels, "maxItems": limits.max_score_levels,
              "description": "the scale, lowest level first: a description per level (the answer is the expected "
                             "level, with a probability per level)"}
    rate = _object({"state": state, "question": {**instructions, "description": "what to rate, in words"},
                    "levels": levels, "model": model, "images": images}, ["state", "levels"])
    again = _object({
        "state": {"type": "string", "pattern": f"^{DIGEST.pattern}$",
                  "description": "the state digest an earlier answer returned (its `state` line)"},
        "questions": copy.deepcopy(decide["properties"]["questions"]),
    }, ["state", "questions"])
    listing = {"type": "object", "properties": {}, "additionalProperties": False}
    after = (" Every answer ends with the state's digest: pass it to ask_again to ask more about the same state "
             "without sending it again.")
    return [
        ToolSpec("decide", "Answer a Clef SystemOne request",
                 "Answer a schema of typed questions (noul: yes/no, choice: one of several labels, score: a level "
                 "on a scale) about a state, in one pass of a local Clef decision model: a probability for every "
                 "allowed option, never free text. The request and the response are those of POST /v1/systemone."
                 + after, decide, response),
        ToolSpec("ask_yes_no", "Ask a yes/no question",
                 "Ask one yes/no question about a state; the answer's `noul` is the probability of yes." + after,
                 yes_no, response),
        ToolSpec("choose", "Choose one of several options",
                 "Ask which of several labelled options fits a state (routing, classification, picking a tool); "
                 "the answer is the most probable label with a probability per label." + after, choose, response),
        ToolSpec("rate", "Rate on a scale",
                 "Place a state on an ordered scale (severity, urgency, risk); the answer's `score` is the expected "
                 "level (0 = the first level), with a probability per level." + after, rate, response),
        ToolSpec("ask_again", "Ask more about a state already sent",
                 "Ask new questions (a decide schema) about a state sent before, named by the digest its answer "
                 "returned: the model reuses its work on that state, so only the new questions cost time.",
                 again, response),
        ToolSpec("models", "List the served models",
                 "The models this server answers with: name, context, limits, weights, whether images are "
                 "accepted, and the state cache's counters.", listing),
    ]


# ---------------------------------------------------------------- arguments → requests


def _invalid(loc: Sequence[Any], msg: str, error_type: str) -> RequestValidationError:
    return RequestValidationError([{"loc": ["body", *loc], "msg": msg, "type": error_type}])


def image_value(value: Any, loc: Sequence[Any]) -> Any:
    """An image argument as the request takes it: an MCP image content block becomes a data URI (what
    :mod:`clef_local.runtime.media` decodes under the media limits); anything else is passed on as it is."""
    if not (isinstance(value, dict) and value.get("type") == "image"):
        return value
    data, mime = value.get("data"), value.get("mimeType")
    if not isinstance(data, str) or not isinstance(mime, str) or not mime.isascii() or not mime.strip():
        raise _invalid(loc, "an MCP image needs 'data' (base64 image bytes) and 'mimeType' (image/png, image/jpeg, "
                            "...)", "image_content")
    return f"data:{mime.strip()};base64,{data}"


def convert_images(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with the MCP image blocks of ``images`` and of each video's frames turned into data URIs."""
    out = dict(body)
    if isinstance(out.get("images"), list):
        out["images"] = [image_value(v, ("images", i)) for i, v in enumerate(out["images"])]
    if isinstance(out.get("videos"), list):
        out["videos"] = [[image_value(f, ("videos", i, j)) for j, f in enumerate(v)] if isinstance(v, list) else v
                         for i, v in enumerate(out["videos"])]
    return out


def _check_arguments(tool: str, args: Mapping[str, Any], allowed: Sequence[str], required: Sequence[str]) -> None:
    unknown = [k for k in args if k not in allowed]
    missing = [k for k in required if args.get(k) is None]  # null for a required argument is not giving it
    problems = [{"loc": ["body", k], "type": "extra_forbidden",
                 "msg": f"{short(str(k))!r} is not an argument of {tool}; it takes {', '.join(allowed)}"}
                for k in unknown[:5]]
    problems += [{"loc": ["body", k], "type": "missing", "msg": f"{k} is required"} for k in missing]
    if problems:
        raise RequestValidationError(problems)


def decide_call(args: Mapping[str, Any], default_model: str) -> Call:
    """``decide``: the arguments are the request (``model`` absent or null: the default model)."""
    return Call(convert_images({**args, "model": _model(args, default_model)}))


def _model(args: Mapping[str, Any], default_model: str) -> Any:
    # agents often send null for an optional argument: that means "not given", as leaving it out does
    value = args.get("model")
    return default_model if value is None else value


TYPED = {  # tool -> (question type, the argument that holds the criteria)
    "ask_yes_no": ("noul", "criteria"),
    "choose": ("choice", "options"),
    "rate": ("score", "levels"),
}


def typed_call(tool: str, args: Mapping[str, Any], default_model: str) -> Call:
    """``ask_yes_no`` / ``choose`` / ``rate``: the one-question request ``{"questions": {"answer": ...}}``; a problem
    with the question's instructions names ``question``, with its criteria the tool's own argument."""
    kind, criteria = TYPED[tool]
    _check_arguments(tool, args, ("state", "question", criteria, "model", "images"),
                     ("state", "question") if kind == "noul" else ("state", criteria))
    question: dict[str, Any] = {"type": kind, "instructions": args.get("question")}
    if criteria in args:
        question["criteria"] = args[criteria]
    body = {"model": _model(args, default_model), "questions": {ANSWER_ID: question},
            **{k: args[k] for k in ("state", "images") if k in args}}

    def rename(loc: Sequence[Any]) -> list[Any]:
        if len(loc) >= 3 and loc[0] == "questions" and loc[1] == ANSWER_ID:
            return ["question" if loc[2] == "instructions" else criteria, *loc[3:]]
        return list(loc)

    return Call(convert_images(body), rename, strip=f"question {ANSWER_ID!r}: ")


def again_call(args: Mapping[str, Any]) -> str:
    """``ask_again``'s digest, checked (the questions are checked with the state's request)."""
    _check_arguments("ask_again", args, ("state", "questions"), ("state", "questions"))
    digest = args["state"]
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        shown = repr(short(digest)) if isinstance(digest, str) else f"a {type(digest).__name__}"
        raise _invalid(("state",), f"state must be the 64-hex-digit digest an earlier answer returned; got {shown}",
                       "state_digest")
    return digest


# ---------------------------------------------------------------- errors


def tool_error(exc: ClefError, call: Call | None = None, argument: str | None = None) -> ToolError:
    """``exc`` as a tool error: the message one line, each validation problem named by its argument path
    (``argument``: the one a non-validation error is about, such as ``model`` for an unknown model)."""
    if isinstance(exc, RequestValidationError):
        errors = []
        for item in exc.errors:
            loc = list(item.get("loc", ()))
            loc = loc[1:] if loc[:1] == ["body"] else loc
            path = call.rename(loc) if call is not None else loc
            msg = one_line(item.get("msg", ""))
            if call is not None and call.strip and msg.startswith(call.strip):
                msg = msg.removeprefix(call.strip)
            errors.append({"field": ".".join(str(p) for p in path) or "arguments", "loc": path, "msg": msg,
                           "type": str(item.get("type", ""))})
        message = "invalid arguments: " + "; ".join(f"{e['field']}: {e['msg']}" for e in errors)
        return ToolError(exc.status_code, exc.error_type, short(message, MESSAGE_LIMIT), errors)
    message = short(one_line(exc), MESSAGE_LIMIT)
    errors = [{"field": argument, "loc": [argument], "msg": message, "type": exc.error_type}] if argument else []
    return ToolError(exc.status_code, exc.error_type, message, errors)
