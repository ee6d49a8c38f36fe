"""The schema builder's state and its two-way mapping to a SystemOne request (pure functions, no Gradio).

A :class:`QuestionDraft` holds plain strings, as the page does; options are one per line (``label: description``,
or one level per line for a score). A field that is valid JSON starting with ``{``, ``[`` or ``"`` is read as that
value, so structured texts survive a round trip; ``null`` in a noul description means "no description".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

STATE_MODES = ("text", "JSON")
EXAMPLES = {"ticket triage": "triage", "content moderation": "moderation", "agent routing": "routing"}
DEFAULT_MODEL_NAME = "clef-local"
_JSON_STARTS = ("{", "[", '"')
_SEPARATOR = ": "


class BuilderError(ValueError):
    """The builder's fields cannot form a request; ``messages`` are in the API's ``loc: msg`` style."""

    def __init__(self, messages: list[str]) -> None:
        self.messages = messages
        super().__init__("; ".join(messages))


@dataclass(frozen=True)
class QuestionDraft:
    """One question as the page holds it (every field a string)."""

    id: str = ""
    type: str = "choice"
    instructions: str = ""
    options: str = ""  # choice: "label: description" lines; score: level lines
    noul_true: str = ""  # noul: description of the true option ("" = the default one, "null" = none)
    noul_false: str = ""

    def fields(self) -> list[str]:
        """The values in the order the page lays out a question's inputs (see :data:`FIELDS`)."""
        return [self.id, self.type, self.instructions, self.options, self.noul_true, self.noul_false]


FIELDS = ("id", "type", "instructions", "options", "noul_true", "noul_false")


def drafts_from_values(values: list[Any]) -> list[QuestionDraft]:
    """Rebuild drafts from the page's flat list of input values (``len(FIELDS)`` per question)."""
    n = len(FIELDS)
    if len(values) % n:
        raise ValueError(f"expected {n} values per question, got {len(values)} values")
    return [QuestionDraft(*["" if v is None else str(v) for v in values[i : i + n]])
            for i in range(0, len(values), n)]


# ------------------------------------------------------------------ text fields


def decode_text(text: str) -> Any:
    """A field's value: JSON when the text is JSON starting with ``{``, ``[`` or ``"``, else the text itself."""
    stripped = text.strip()
    if stripped.startswith(_JSON_STARTS):
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            return text
    return text


def encode_text(value: Any) -> str:
    """The inverse of :func:`decode_text`: plain text where that reads back identically, else JSON."""
    plain = isinstance(value, str) and value.strip() and "\n" not in value and value == value.strip()
    if plain and decode_text(value) == value:
        return value
    return json.dumps(value, ensure_ascii=False)


def _decode_line(line: str) -> Any:
    """One option or level: JSON as read, plain text without its surrounding spaces."""
    value = decode_text(line)
    return line.strip() if value is line else value


def parse_choice_options(text: str, qid: str) -> dict[str, Any]:
    """``label`` / ``label: description`` lines (or ``["label", description]`` JSON lines) → criteria."""
    criteria: dict[str, Any] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        value = decode_text(line)
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
            label, description = value
        elif isinstance(value, str):
            label, _, rest = line.strip().partition(_SEPARATOR)
            description = _decode_line(rest) if rest.strip() else None
        else:
            raise BuilderError([f"body.questions.{qid}.criteria: option line {number} is JSON but not a "
                                '["label", description] pair; write "label: description"'])
        if label in criteria:
            raise BuilderError([f"body.questions.{qid}.criteria: the label {label!r} appears twice; "
                                "labels must be unique"])
        criteria[label] = description
    return criteria


def format_choice_options(criteria: dict[str, Any]) -> str:
    lines = []
    for label, description in criteria.items():
        plain_label = label == label.strip() and _SEPARATOR not in label and decode_text(label) == label
        if plain_label and "\n" not in label and description is None:
            lines.append(label)
        elif plain_label and "\n" not in label and isinstance(description, str) and description.strip():
            lines.append(f"{label}{_SEPARATOR}{encode_text(description)}")
        else:
            lines.append(json.dumps([label, description], ensure_ascii=False))
    return "\n".join(lines)


def parse_score_levels(text: str) -> list[Any]:
    return [_decode_line(line) for line in text.splitlines() if line.strip()]


def format_score_levels(levels: list[Any]) -> str:
    return "\n".join(encode_text(level) for level in levels)


def _noul_description(text: str) -> tuple[bool, Any]:
    """(present, value) of one noul description field."""
    if not text.strip():
        return False, None
    if text.strip() == "null":
        return True, None
    return True, decode_text(text)


def _format_noul(criteria: dict[str, Any] | None, key: str) -> str:
    if not criteria or key not in criteria:
        return ""
    value = criteria[key]
    if value is None:
        return "null"
    return json.dumps(value) if value == "null" else encode_text(value)


# ------------------------------------------------------------------ drafts ↔ request


def draft_to_question(draft: QuestionDraft) -> dict[str, Any]:
    """One draft as a SystemOne question object (not yet validated)."""
    question: dict[str, Any] = {"type": draft.type}
    if draft.instructions.strip():
        question["instructions"] = decode_text(draft.instructions)
    if draft.type == "choice":
        question["criteria"] = parse_choice_options(draft.options, draft.id)
    elif draft.type == "score":
        question["criteria"] = parse_score_levels(draft.options)
    elif draft.type == "noul":
        criteria = {}
        for key, text in (("true", draft.noul_true), ("false", draft.noul_false)):
            present, value = _noul_description(text)
            if present:
                criteria[key] = value
        if criteria:
            question["criteria"] = criteria
    return question


def parse_state(mode: str, text: str) -> Any:
    """The request's ``state``: the text itself, or the parsed JSON value in JSON mode."""
    if mode == "text":
        return text
    if mode != "JSON":
        raise BuilderError([f"body.state: unknown state mode {mode!r}; use one of {', '.join(STATE_MODES)}"])
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BuilderError([f"body.state: not valid JSON ({exc.msg}, line {exc.lineno} column {exc.colno}); "
                            "fix it or switch the state to text"]) from None


def build_request(drafts: list[QuestionDraft], state_mode: str, state_text: str,
                  model: str = DEFAULT_MODEL_NAME) -> dict[str, Any]:
    """The SystemOne request the builder describes; raises :class:`BuilderError` when it cannot be formed.

    The request is *not* validated here: :func:`validation_messages` does that with the API's own validator.
    """
    errors: list[str] = []
    questions: dict[str, Any] = {}
    first_seen: dict[str, int] = {}
    for number, draft in enumerate(drafts, start=1):
        if draft.id in first_seen:
            errors.append(f"body.questions.{draft.id}: question {number} reuses the id of question "
                          f"{first_seen[draft.id]}; ids must be unique")
            continue
        first_seen[draft.id] = number
        try:
            questions[draft.id] = draft_to_question(draft)
        except BuilderError as exc:
            errors.extend(exc.messages)
    try:
        state = parse_state(state_mode, state_text)
    except BuilderError as exc:
        errors.extend(exc.messages)
        state = None
    if errors:
        raise BuilderError(errors)
    return {"model": model, "state": state, "questions": questions}


def request_to_drafts(request: Any) -> tuple[list[QuestionDraft], str, str]:
    """A request (e.g. imported JSON) as builder drafts plus state mode and text; validated first."""
    from clef_local.runtime.schema import validate_request

    validate_request(request)  # the API's messages for anything the builder could not show
    drafts = []
    for qid, question in request["questions"].items():
        qtype = question["type"]
        criteria = question.get("criteria")
        instructions = question.get("instructions")
        text = "" if instructions is None else encode_text(instructions)
        draft = QuestionDraft(id=qid, type=qtype, instructions=text)
        if qtype == "choice":
            draft = replace(draft, options=format_choice_options(criteria))
        elif qtype == "score":
            draft = replace(draft, options=format_score_levels(criteria))
        else:
            draft = replace(draft, noul_true=_format_noul(criteria, "true"), noul_false=_format_noul(criteria, "false"))
        drafts.append(draft)
    state = request["state"]
    if isinstance(state, str):
        return drafts, "text", state
    return drafts, "JSON", json.dumps(state, ensure_ascii=False, indent=2)


def validation_messages(request: Any) -> list[str]:
    """The API's validation messages for a request (``body.loc: msg``, as the 422 body has them); [] if valid."""
    from clef_local.errors import RequestValidationError
    from clef_local.runtime.schema import validate_request

    try:
        validate_request(request)
    except RequestValidationError as exc:
        return [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors]
    return []


# ------------------------------------------------------------------ editing


def new_draft(drafts: list[QuestionDraft]) -> QuestionDraft:
    """A fresh choice question with an id not used yet."""
    taken = {d.id for d in drafts}
    n = len(drafts) + 1
    while f"q{n}" in taken:
        n += 1
    return QuestionDraft(id=f"q{n}", type="choice")


def move(drafts: list[QuestionDraft], index: int, offset: int) -> list[QuestionDraft]:
    """The drafts with ``index`` moved by ``offset`` (−1 up, +1 down); unchanged at either end."""
    target = index + offset
    if not 0 <= index < len(drafts) or not 0 <= target < len(drafts):
        return list(drafts)
    out = list(drafts)
    out[index], out[target] = out[target], out[index]
    return out


def remove(drafts: list[QuestionDraft], index: int) -> list[QuestionDraft]:
    return [d for i, d in enumerate(drafts) if i != index]


def example_request(name: str) -> dict[str, Any]:
    """A built-in example request: ``triage``, ``moderation`` or ``routing`` (or its display name)."""
    key = EXAMPLES.get(name, name)
    if key not in EXAMPLES.values():
        raise ValueError(f"unknown example {name!r}; choose one of {', '.join(EXAMPLES)}")
    return json.loads(resources.files("clef_local.demo.examples").joinpath(f"{key}.json").read_text(encoding="utf-8"))


def parse_request_json(text: str) -> Any:
    """Imported request JSON text → value; a parse error is a message in the API's style."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BuilderError([f"body: JSON decode error: {exc.msg} (line {exc.lineno}, column {exc.colno})"]) from None
