"""``multipart/form-data`` bodies of ``POST /v1/systemone``, what typesafe-sdk sends for its ``Image`` assets: the
request JSON in the part ``request``, each image in a part an asset names. :func:`split_multipart` only splits (a
malformed body is a 422); ``ClefModel.encode`` decodes the images. docs/serving.md#media.
"""

from __future__ import annotations

import re

from clef_local.errors import RequestValidationError

MULTIPART = "multipart/form-data"
REQUEST_PART = "request"  # typesafe-sdk's name for the JSON part
MAX_PARTS = 65  # the request + 64 images; the model's MediaLimits.max_images decides how many are used
_PARAM = re.compile(r';\s*([!#$%&\'*+.^_`|~0-9A-Za-z-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;\s]*)')
_HEADER = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+)[ \t]*:[ \t]*(.*)")


def _invalid(msg: str, error_type: str = "multipart_invalid") -> RequestValidationError:
    return RequestValidationError([{"loc": ["body"], "msg": msg, "type": error_type}])


def is_multipart(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == MULTIPART


def _params(header: str) -> dict[str, str]:
    """``key=value`` parameters of a header value (quoted values unescaped), keys lower-cased."""
    out: dict[str, str] = {}
    for key, value in _PARAM.findall(header):
        if value.startswith('"'):
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        out[key.lower()] = value
    return out


def split_multipart(body: bytes, content_type: str) -> tuple[bytes, dict[str, bytes]]:
    """The ``request`` part's bytes and the other parts by name; a malformed body raises a 422."""
    boundary = _params(content_type).get("boundary", "")
    if not 1 <= len(boundary) <= 70:
        raise _invalid("multipart/form-data needs a boundary parameter of 1 to 70 characters")
    delimiter = b"--" + boundary.encode("latin-1")
    start = body.find(delimiter)
    if start < 0:
        raise _invalid("the multipart body does not contain its boundary")
    chunks = body[start + len(delimiter):].split(b"\r\n" + delimiter)
    if not chunks[-1].startswith(b"--"):
        raise _invalid("the multipart body is truncated (no closing boundary)")
    parts: dict[str, bytes] = {}
    for chunk in chunks[:-1]:
        if not chunk.startswith(b"\r\n"):
            raise _invalid("a multipart boundary must be followed by CRLF")
        head, sep, content = chunk[2:].partition(b"\r\n\r\n")
        if not sep:
            raise _invalid("a multipart part has no blank line after its headers")
        name = _part_name(head)
        if name in parts:
            raise _invalid(f"the multipart body has two parts named {name[:100]!r}")
        parts[name] = content
        if len(parts) > MAX_PARTS:
            raise _invalid(f"the multipart body has more than {MAX_PARTS} parts")
    if REQUEST_PART not in parts:
        raise _invalid(f"the multipart body has no part named {REQUEST_PART!r} holding the request JSON "
                       f"(parts: {', '.join(sorted(parts))[:300] or 'none'})")
    return parts.pop(REQUEST_PART), parts


def _part_name(head: bytes) -> str:
    disposition = None
    for line in head.split(b"\r\n"):
        match = _HEADER.fullmatch(line)
        if not match:
            raise _invalid(f"a multipart part has a malformed header line {line[:80]!r}")
        if match.group(1).lower() == b"content-disposition":
            disposition = match.group(2).decode("utf-8", "replace")
    if disposition is None or disposition.split(";", 1)[0].strip().lower() != "form-data":
        raise _invalid("every multipart part needs 'Content-Disposition: form-data; name=\"...\"'")
    name = _params(disposition).get("name")
    if not name:
        raise _invalid("a multipart part has no name")
    return name
