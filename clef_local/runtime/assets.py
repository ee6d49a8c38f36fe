"""Jev's ``assets`` form mapped onto the reference's ``images`` (:func:`map_assets`; docs/format.md §7).

Clef has no image positions inside the text, so the assets become images in the order their placeholders first
appear in the prompt, each placeholder is replaced by ``<image N>``, and an asset or reference that does not pair
up is a 422. Nothing is decoded here: :mod:`clef_local.runtime.media` decodes what this returns.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from clef_local.errors import RequestValidationError
from clef_local.runtime.encoding import question_options
from clef_local.runtime.schema import SystemOneRequest

ASSET_FORMATS = ("png", "jpg", "jpeg")  # Jev's wire enum; the bytes' own format is what is decoded
SDK_REFERENCE = re.compile(r"<image:[0-9a-f]{32}>")  # what typesafe-sdk's Image serializes as


def marker(number: int) -> str:
    """The text that replaces a placeholder of the image at 1-based position ``number`` after the prefix."""
    return f"<image {number}>"


def invalid(loc: list[Any], msg: str, error_type: str = "asset_invalid") -> RequestValidationError:
    """A 422 naming ``body.<loc>``."""
    return RequestValidationError([{"loc": ["body", *loc], "msg": msg, "type": error_type}])


@dataclass(frozen=True)
class AssetImage:
    """One asset to decode: its placeholder, where it came from (for messages) and its raw value."""

    name: str
    loc: tuple[Any, ...]  # ("assets", name)
    data: str | bytes  # base64 text (data_base64) or the multipart part's bytes


@dataclass(frozen=True)
class MappedAssets:
    """The request with placeholders replaced (no ``assets`` left), and the assets in image order."""

    request: SystemOneRequest
    images: list[AssetImage]


def _check_entry(name: Any, entry: Any, parts: Mapping[str, bytes] | None) -> str | bytes:
    """The raw data of one asset entry (base64 text or part bytes); a 422 naming it when malformed."""
    loc: list[Any] = ["assets", name]
    if not isinstance(name, str) or not name.strip():
        raise invalid(["assets"], f"asset placeholders must be non-empty strings; got {name!r}")
    if not isinstance(entry, dict):
        raise invalid(loc, f"asset {name!r} must be an object {{\"type\": \"image\", \"format\", \"data_base64\"}} "
                           f"or {{\"type\": \"image\", \"part\"}}; got {type(entry).__name__}")
    kind = entry.get("type", "image")
    if kind != "image":
        raise invalid([*loc, "type"], f"asset {name!r} has type {kind!r}; only \"image\" assets exist (a video is "
                                      "sent as frames in the reference form's \"videos\")", "asset_type")
    part = entry.get("part")
    if part is not None:  # Jev: with part, data_base64 is ignored
        if not isinstance(part, str) or not part:
            raise invalid([*loc, "part"], f"asset {name!r}: part must name a part of the multipart body")
        if parts is None:
            raise invalid([*loc, "part"], f"asset {name!r} names the multipart part {part!r}, but the body is not "
                                          "multipart/form-data; send data_base64 instead", "asset_part")
        if part not in parts:
            raise invalid([*loc, "part"], f"asset {name!r} names the part {part!r}, which the multipart body does "
                                          f"not have (parts: {', '.join(sorted(parts)) or 'none'})", "asset_part")
        return parts[part]
    data = entry.get("data_base64")
    if data is None:
        raise invalid(loc, f"asset {name!r} has neither data_base64 nor part", "asset_missing_data")
    if not isinstance(data, str):
        raise invalid([*loc, "data_base64"], f"asset {name!r}: data_base64 must be a string of base64 text")
    fmt = entry.get("format")
    if fmt is None:
        raise invalid([*loc, "format"], f"asset {name!r}: format is required with data_base64 (one of "
                                        f"{', '.join(ASSET_FORMATS)})", "asset_format")
    if not isinstance(fmt, str) or fmt.lower() not in ASSET_FORMATS:
        raise invalid([*loc, "format"], f"asset {name!r}: format {fmt!r} is not one of {', '.join(ASSET_FORMATS)}",
                      "asset_format")
    return data


def _claim_parts(assets: Mapping[str, Any], parts: Mapping[str, bytes]) -> None:
    """Every part is claimed by exactly one asset (Jev's rule: an image under two names is sent twice)."""
    claimed: dict[str, str] = {}
    for name, entry in assets.items():
        part = entry.get("part") if isinstance(entry, dict) else None
        if isinstance(part, str):
            if part in claimed:
                raise invalid(["assets", name, "part"], f"assets {claimed[part]!r} and {name!r} both name the part "
                                                        f"{part!r}; each part belongs to one asset", "asset_part")
            claimed[part] = name
    unclaimed = sorted(set(parts) - set(claimed))
    if unclaimed:
        raise invalid(["assets"], f"the multipart body has parts no asset names: {', '.join(unclaimed)}",
                      "asset_part")


def _strings(value: Any) -> Iterator[str]:
    """The strings of a JSON value in rendered order (object keys sorted, as ``render`` sorts them); keys are not
    included (a placeholder in an object key, a question id or an option label is not replaced)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key in sorted(value):
            yield from _strings(value[key])
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _rewrite(value: Any, rewrite: Callable[[str], str]) -> Any:
    """A copy of a JSON value with ``rewrite`` applied to every string that is not an object key."""
    if isinstance(value, str):
        return rewrite(value)
    if isinstance(value, dict):
        return {k: _rewrite(v, rewrite) for k, v in value.items()}
    if isinstance(value, list):
        return [_rewrite(v, rewrite) for v in value]
    return value


def _prompt_texts(request: SystemOneRequest) -> Iterator[tuple[tuple[str, ...], Any]]:
    """``(path, value)`` of every place a placeholder may appear, in the order the prompt shows them."""
    yield ("state",), request.state
    for qid, question in request.questions.items():
        yield ("questions", qid, "instructions"), question.instructions
        criteria = question.criteria
        if question.type == "score" and isinstance(criteria, list):
            for level in range(len(criteria)):
                yield ("questions", qid, "criteria", str(level)), criteria[level]
        elif isinstance(criteria, dict):
            for option, _ in question_options(question):  # model order (docs/format.md §2)
                if option in criteria:
                    yield ("questions", qid, "criteria", option), criteria[option]


def check_references(request: SystemOneRequest) -> None:
    """A request without assets must not name typesafe-sdk images (``<image:…>``): the SDK sends an ``Image`` it
    was not given (not attached, not in ``assets``, not placed in the content) as its reference text only."""
    for _, value in _prompt_texts(request):
        for text in _strings(value):
            if "<image:" in text and (found := SDK_REFERENCE.search(text)):
                raise invalid(["assets"], f"the request refers to {found.group()!r}, which no asset provides; pass "
                                          "that image in assets (typesafe-sdk: assets=, attach_assets or the Image "
                                          "itself)", "asset_missing")


def map_assets(request: SystemOneRequest, assets: Any, *, first_number: int = 1,
               parts: Mapping[str, bytes] | None = None) -> MappedAssets:
    """Replace the placeholders of ``assets`` in ``request`` by image markers.

    ``first_number`` is the marker number of the first asset image (1 + the count of reference-form images).
    ``parts`` are a multipart body's parts by name (``None``: the body was JSON). The input is not modified.
    """
    if not isinstance(assets, dict):
        raise invalid(["assets"], f"assets must be an object mapping placeholders to assets; got "
                                  f"{type(assets).__name__}")
    if not assets:
        raise invalid(["assets"], "assets must not be empty (leave the field out instead)")
    data = {name: _check_entry(name, entry, parts) for name, entry in assets.items()}
    if parts is not None:
        _claim_parts(assets, parts)

    names = sorted(assets, key=len, reverse=True)  # the longest placeholder wins where one contains another
    pattern = re.compile("|".join(re.escape(n) for n in names))
    order: list[str] = []
    strays: list[str] = []

    def visit(text: str) -> None:
        for match in pattern.finditer(text):
            if match.group() not in order:
                order.append(match.group())
        strays.extend(r for r in SDK_REFERENCE.findall(text) if r not in assets and r not in strays)

    for _, value in _prompt_texts(request):
        for text in _strings(value):
            visit(text)
    if strays:
        raise invalid(["assets"], f"the request refers to {strays[0]!r}, which no asset provides; pass that image "
                                  "in assets (typesafe-sdk: assets=, attach_assets or the Image itself)",
                      "asset_missing")
    unused = [n for n in assets if n not in order]
    if unused:
        raise invalid(["assets", unused[0]], f"asset {unused[0]!r} is never referenced: put its placeholder in a "
                                             "string of the state, an instruction or a criterion's description "
                                             "(not in an object key, question id or option label), or leave it out",
                      "asset_unreferenced")
    numbers = {name: first_number + i for i, name in enumerate(order)}

    def rewrite(text: str) -> str:
        return pattern.sub(lambda m: marker(numbers[m.group()]), text)

    questions = {qid: q.model_copy(update={"instructions": _rewrite(q.instructions, rewrite),
                                           "criteria": _rewrite(q.criteria, rewrite)})
                 for qid, q in request.questions.items()}
    out = request.model_copy(update={"state": _rewrite(request.state, rewrite), "questions": questions,
                                     "assets": None})
    images = [AssetImage(name, ("assets", name), data[name]) for name in order]
    return MappedAssets(out, images)
