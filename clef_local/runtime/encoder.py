"""The one way a request becomes something a model runs: validate, bound its size, decode its media, tokenize.

:class:`RequestEncoder` does it once per request, for every caller (``decide``, ``predict``, the server, ``batch``,
``eval``, ``drift``): it returns an :class:`~clef_local.runtime.encoding.EncodedRecord` that carries the validated
request, so nothing downstream sees the raw body again. The steps are docs/format.md §2 (encoding) and §7 (media).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from clef_local.errors import ApiUsageError, MaxTokensExceededError, short
from clef_local.runtime.assets import check_references, invalid
from clef_local.runtime.encoding import EncodedRecord, encode_request, option_semantics, question_options
from clef_local.runtime.media import DEFAULT_MEDIA_LIMITS, MediaLimits, resolve_media
from clef_local.runtime.processor import MediaProcessor
from clef_local.runtime.schema import DEFAULT_LIMITS, Limits, SystemOneRequest, validate_request
from clef_local.runtime.tokenizer import ReleaseTokenizer

OPTION_WRAPPER_BYTES = len(option_semantics("", None))  # '{"option_id":""}' around every option's label


@dataclass(frozen=True)
class MediaSupport:
    """Whether this model reads images here, and if not, why (the 400 a media request gets)."""

    processor: MediaProcessor | None
    refusal: str | None = None  # None: media are accepted


class RequestEncoder:
    """Encodes requests for one loaded model: its tokenizer, context, limits and media support."""

    def __init__(self, tokenizer: ReleaseTokenizer, *, max_length: int, limits: Limits = DEFAULT_LIMITS,
                 media: MediaSupport = MediaSupport(None, "this model has no vision tower"),
                 media_limits: MediaLimits = DEFAULT_MEDIA_LIMITS, pad_ids: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.limits = limits
        self.media = media
        self.media_limits = media_limits
        self.pad_ids = pad_ids  # the vision pad tokens, which only the processor may place
        self.max_token_bytes: int = tokenizer.max_token_bytes  # the most bytes of text one token covers

    def validate(self, request: Mapping[str, Any] | SystemOneRequest) -> SystemOneRequest:
        """The validated request (422 :class:`~clef_local.errors.RequestValidationError` otherwise)."""
        return request if isinstance(request, SystemOneRequest) else validate_request(request, self.limits)

    def encode(self, request: Mapping[str, Any] | SystemOneRequest, *, truncate_state: bool = False,
               parts: Mapping[str, bytes] | None = None) -> EncodedRecord:
        """Validate (unless already validated), refuse text that cannot fit before tokenizing it (413), decode the
        images and videos (``parts``: a multipart body's parts), tokenize."""
        validated = self.validate(request)
        if not (validated.images or validated.videos or validated.assets is not None or parts):
            check_references(validated)
            self.check_size(validated, truncate_state=truncate_state)
            return encode_request(self.tokenizer, validated, max_length=self.max_length,
                                  truncate_state=truncate_state)
        processor = self.media_processor()  # refused before anything is decoded
        media = resolve_media(validated, limits=self.media_limits, parts=parts)
        self.check_size(media.request, truncate_state=truncate_state)  # as encoded: assets' markers in place
        inputs = processor.encode(media.images, media.videos, max_tokens=self.max_length)
        encoded = encode_request(self.tokenizer, media.request, max_length=self.max_length,
                                 truncate_state=truncate_state, media=inputs)
        # The vision tower fills exactly the media's pad tokens: a pad token typed into the text would shift them.
        if sum(1 for t in encoded.input_ids if t in self.pad_ids) != inputs.visual_tokens:
            raise invalid([], "the state or the questions contain the vision placeholder tokens <|image_pad|> or "
                              "<|video_pad|> as text; remove them from a request with images or videos",
                          "vision_token_in_text")
        return encoded

    def media_processor(self) -> MediaProcessor:
        """The release's media processor; ``ApiUsageError`` (400) with the reason when media are refused here."""
        if self.media.processor is None or self.media.refusal is not None:
            raise ApiUsageError(self.media.refusal or "this model does not read images or videos")
        return self.media.processor

    def check_size(self, request: SystemOneRequest, *, truncate_state: bool = False) -> int:
        """Refuse, without tokenizing it, a request whose text cannot fit the context; else return the lower
        bound on its prompt's tokens that it was checked with.

        No token covers more than ``max_token_bytes`` bytes, so each prompt piece (docs/format.md §2) needs at least
        ``ceil(bytes / max_token_bytes)`` tokens: a field, or all of them, over the context by that count is a 413
        naming it at once (tokenizing a 10 MB field only to fail would hold a thread for seconds and grow the
        process by gigabytes). With ``truncate_state`` the state is left out (it is cut to fit).
        """
        fields = list(text_fields(request, include_state=not truncate_state))
        per_token = self.max_token_bytes
        # template pieces, one token at least each: prefix, schema header, suffix; per question "ALLOWED OPTIONS"
        # and "END FIELD"; per option "OPTION k: " and its newline
        total = 3 + sum(2 + 2 * len(question_options(q)) for q in request.questions.values())
        largest = ("", 0)
        for name, size in fields:
            tokens = -(-size // per_token)
            if tokens > self.max_length:
                raise MaxTokensExceededError(
                    f"{name}: {size:,} bytes of text, so at least {tokens:,} tokens (no token of this model covers "
                    f"more than {per_token} bytes); the context is {self.max_length:,} tokens: shorten it",
                    input_tokens=tokens, max_tokens=self.max_length)
            total += tokens
            largest = max(largest, (name, size), key=lambda field: field[1])
        if total > self.max_length:
            raise MaxTokensExceededError(
                f"the request needs at least {total:,} tokens ({len(fields)} text fields, the largest {largest[0]} "
                f"with {largest[1]:,} bytes; no token of this model covers more than {per_token} bytes); the "
                f"context is {self.max_length:,} tokens: send a shorter state, fewer questions or fewer options",
                input_tokens=total, max_tokens=self.max_length)
        return total


def text_fields(request: SystemOneRequest, *, include_state: bool = True) -> Iterator[tuple[str, int]]:
    """``(name, bytes)`` of each piece of a request's prompt that holds its text (docs/format.md §2).

    Bytes are a lower bound on the rendered piece's UTF-8 size (:func:`text_bytes`); a question id counts twice
    when it stands in for missing instructions, as in the prompt. Names are shortened for messages.
    """
    if include_state:
        yield "the state", text_bytes(request.state)
    for question_id, question in request.questions.items():
        where = f"question {short(question_id)!r}"
        id_bytes = text_bytes(question_id)
        yield f"the id of {where}", id_bytes
        instructions = question.instructions
        missing = instructions is None or instructions == ""
        yield f"the instructions of {where}", id_bytes if missing else text_bytes(instructions)
        for option_id, description in question_options(question):
            described = 0 if description is None else text_bytes(description)
            yield f"option {short(option_id)!r} of {where}", OPTION_WRAPPER_BYTES + text_bytes(option_id) + described


def text_bytes(value: Any) -> int:
    """At most the UTF-8 size of ``value`` rendered as the prompt renders it, without rendering it: a string's own
    bytes; for an object or array, the bytes of every key and string plus one per other value (JSON adds quotes,
    separators and escapes, never removes). Iterative, so any nesting depth is fine."""
    size = 0
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            size += len(node) if node.isascii() else len(node.encode("utf-8", "surrogatepass"))
        elif isinstance(node, dict):
            size += 2
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            size += 2
            stack.extend(node)
        else:
            size += 1
    return size
