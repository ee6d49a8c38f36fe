"""Request bodies, from bytes on the wire to a JSON value, every failure a 4xx (no web framework here): the size is
bounded before and while decompressing (a small zstd bomb cannot expand past it), only JSON is read (a web page can
send forms without the browser asking, never JSON), and ``NaN``, nesting over :data:`MAX_DEPTH`, lone surrogates and
duplicate keys (parsers disagree on which wins) are refused at the door. docs/serving.md ("Bodies").
"""

from __future__ import annotations

import json
import math
import re
import zlib
from typing import Any

from clef_local.errors import ClefError, RequestValidationError

MAX_DEPTH = 64  # nesting levels of objects and arrays; real states are far shallower
_CHUNK = 1 << 16
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


class BodyTooLargeError(ClefError):
    """The body (raw or decompressed) is over the server's limit (HTTP 413)."""

    status_code = 413
    error_type = "request_too_large"


class BadEncodingError(ClefError):
    """A ``Content-Encoding`` body that does not decompress (HTTP 400)."""

    status_code = 400
    error_type = "invalid_content_encoding"


class UnsupportedEncodingError(ClefError):
    """A ``Content-Encoding`` this server does not read (HTTP 415)."""

    status_code = 415
    error_type = "unsupported_media_type"


class UnsupportedMediaTypeError(ClefError):
    """A body that is not declared ``application/json`` (HTTP 415)."""

    status_code = 415
    error_type = "unsupported_media_type"


class _DuplicateKeyError(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def check_content_type(value: str | None) -> None:
    """Accept ``application/json`` (any case, with parameters; a ``charset`` must be UTF-8), refuse the rest (415).

    Browsers send ``text/plain``, form and multipart bodies cross-origin without a CORS preflight, so accepting
    them as JSON would let any web page drive a local server; ``application/json`` needs the server's consent.
    ``multipart/form-data`` carries a request's assets (the official SDK's images): a browser sends it with an
    ``Origin`` header, which :mod:`.guard` refuses for any page but the server's own and ``--cors-origin``.
    """
    media, _, params = (value or "").partition(";")
    media = media.strip().lower()
    if media == "application/json":
        for param in params.split(";"):
            name, _, setting = param.partition("=")
            charset = setting.strip().strip('"').lower()
            if name.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
                raise UnsupportedMediaTypeError(f"Content-Type charset {charset[:40]!r} is not supported; JSON bodies "
                                                "are UTF-8: send Content-Type: application/json")
        return
    if not media:
        raise UnsupportedMediaTypeError("the request has no Content-Type; send the JSON body with "
                                        "Content-Type: application/json")
    if media == "multipart/form-data":
        return  # typesafe-sdk's assets (images): a browser's cross-origin form post is refused by the Origin guard
    if media.startswith("multipart/"):
        raise UnsupportedMediaTypeError(f"of multipart bodies only multipart/form-data is read (a request with "
                                        f"assets), not {media[:60]!r}; send application/json or multipart/form-data")
    raise UnsupportedMediaTypeError(f"Content-Type {media[:60]!r} is not supported; send a JSON body with "
                                    "Content-Type: application/json")


def _zstd_module() -> Any:
    try:
        from compression import zstd  # Python 3.14+
    except ImportError:
        from backports import zstd  # the serve extra installs it before 3.14 (as typesafe-sdk[zstd] does)
    return zstd


def _zstd(data: bytes, limit: int) -> bytes:
    """Every frame of ``data``, decompressed a chunk at a time so that output past ``limit`` is never made."""
    zstd = _zstd_module()
    out = bytearray()
    pending = data
    try:
        while pending:
            decoder = zstd.ZstdDecompressor()
            chunk = decoder.decompress(pending, _CHUNK)
            while True:
                out += chunk
                if len(out) > limit:
                    raise BodyTooLargeError(f"the zstd body decompresses to more than {limit} bytes")
                if decoder.eof or decoder.needs_input:
                    break
                chunk = decoder.decompress(b"", _CHUNK)
            if not decoder.eof:
                raise BadEncodingError("the zstd body is truncated")
            pending = decoder.unused_data
    except zstd.ZstdError as exc:
        raise BadEncodingError(f"the body is not valid zstd: {exc}") from None
    return bytes(out)


def _zlib(data: bytes, limit: int, wbits: int, name: str) -> bytes:
    """A zlib stream (``deflate``) or every member of a gzip body, a chunk at a time, never making more than
    ``limit`` bytes; bytes after the end of a deflate stream, or a gzip member that does not decode, are refused."""
    out = bytearray()
    pending = data
    try:
        while pending:
            decoder = zlib.decompressobj(wbits)
            while pending:
                out += decoder.decompress(pending, _CHUNK)
                if len(out) > limit:
                    raise BodyTooLargeError(f"the {name} body decompresses to more than {limit} bytes")
                pending = decoder.unconsumed_tail
                if decoder.eof:
                    break
            out += decoder.flush()
            if not decoder.eof:
                raise BadEncodingError(f"the {name} body is truncated")
            pending = decoder.unused_data
            if pending and name != "gzip":
                raise BadEncodingError(f"the {name} body has {len(pending)} bytes after its end")
    except zlib.error as exc:
        raise BadEncodingError(f"the body is not valid {name}: {exc}") from None
    if len(out) > limit:
        raise BodyTooLargeError(f"the {name} body decompresses to more than {limit} bytes")
    return bytes(out)


def decode_content(data: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo ``Content-Encoding`` (zstd, gzip, deflate, identity; a comma list is applied right to left)."""
    codings = [c.strip().lower() for c in (encoding or "").split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "zstd":
            data = _zstd(data, limit)
        elif coding in ("gzip", "x-gzip"):
            data = _zlib(data, limit, 16 + zlib.MAX_WBITS, "gzip")
        elif coding == "deflate":
            data = _zlib(data, limit, zlib.MAX_WBITS, "deflate")
        elif coding != "identity":
            raise UnsupportedEncodingError(f"Content-Encoding {coding[:40]!r} is not supported; "
                                           "send zstd, gzip, deflate or an uncompressed body")
    return data


def _invalid(msg: str, error_type: str = "json_invalid", loc: list[Any] | None = None) -> RequestValidationError:
    return RequestValidationError([{"loc": ["body", *(loc or [])], "msg": msg, "type": error_type}])


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members as a dict; a key given twice raises (``object_pairs_hook``)."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKeyError(key)
            seen.add(key)
    return value


def parse_json(data: bytes) -> Any:
    """Parse a JSON body; anything unusable raises :class:`RequestValidationError` (HTTP 422)."""
    try:
        text = data.decode("utf-8-sig") if data.startswith(b"\xef\xbb\xbf") else data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid(f"the body is not UTF-8: invalid byte at position {exc.start}", "json_invalid",
                       [exc.start]) from None
    if not text.strip():
        raise _invalid("the request body is empty; send a JSON object with model, state and questions", "missing")
    try:
        value = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_object)
    except _DuplicateKeyError as exc:
        key = exc.key if len(exc.key) <= 60 else exc.key[:59] + "…"
        raise _invalid(f"the key {key!r} appears twice in one JSON object; send each key once", "json_duplicate_key"
                       ) from None
    except json.JSONDecodeError as exc:
        raise _invalid(f"JSON decode error: {exc.msg} (line {exc.lineno}, column {exc.colno})", "json_invalid",
                       [exc.pos]) from None
    except RecursionError:
        raise _invalid(f"JSON nested more than {MAX_DEPTH} levels deep", "json_too_deep") from None
    except ValueError as exc:  # NaN/Infinity, integers with too many digits
        raise _invalid(f"JSON decode error: {exc}", "json_invalid") from None
    check_value(value, surrogates=bool(_SURROGATE_ESCAPE.search(data)))
    return value


def check_value(value: Any, *, surrogates: bool = True) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH`, (when ``surrogates``) strings with lone surrogates, and
    ``NaN`` / infinite numbers (which :func:`parse_json` never lets in; other parsers do, such as the MCP SDK's).

    Iterative, so a hostile document cannot exhaust the stack here either.
    """
    if isinstance(value, str):
        if surrogates:
            _check_text(value)
        return
    _check_number(value)
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _invalid(f"JSON nested more than {MAX_DEPTH} levels deep", "json_too_deep")
        items: Any = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if surrogates:
                for text in (key, child):
                    if isinstance(text, str):
                        _check_text(text)
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
            else:
                _check_number(child)


def _check_number(value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise _invalid(f"{value} is not a JSON number; send a finite number", "json_invalid")


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _invalid(f"a string contains a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x}); "
                       "send valid Unicode", "string_unicode") from None
