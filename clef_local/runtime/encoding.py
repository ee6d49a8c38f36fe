"""Encode a SystemOne request into token ids and spans, exactly as Clef was trained (docs/format.md §2).

Every prompt piece is tokenized on its own (BPE merges never cross pieces) and the ids concatenated; the question
span is the rendered instructions, each option span the rendered ``{"option_id", "description"}``. A request's
distinct pieces go to the tokenizer in one batch call.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Protocol

from clef_local.errors import ApiUsageError, MaxTokensExceededError
from clef_local.runtime.schema import TYPE_IDS, Question, SystemOneRequest

SYSTEM_PROMPT = (
    "Read the complete state and schema. Decide every field jointly. "
    "Each answer must be exactly one of that field's allowed options."
)
PREFIX = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nSTATE:\n"
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
SCHEMA_HEADER = "\n\nSCHEMA FIELDS:\n"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
NOUL_DEFAULTS = {
    "true": "The proposition is true or the answer is yes.",
    "false": "The proposition is false or the answer is no.",
}
# The reference implementation's default request limit (`systemone(max_length=16384)`, which cuts the state to it);
# encode_request's default. clef-local's default is the window Clef and Clef-flash are published with (docs/format.md
# §2), lowered to a backbone with a shorter context.
REFERENCE_MAX_LENGTH = 16384
PUBLISHED_CONTEXT = 65536


def default_max_length(backbone_context: int | None) -> int:
    """The request limit when none is asked for: :data:`PUBLISHED_CONTEXT`, at most the backbone's context."""
    return min(PUBLISHED_CONTEXT, backbone_context or PUBLISHED_CONTEXT)


def checked_max_length(max_length: int | None, backbone_context: int | None) -> int:
    """``max_length`` (None: :func:`default_max_length`), refused (``ApiUsageError``) when not positive or above the
    backbone's context, naming both."""
    if max_length is None:
        return default_max_length(backbone_context)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ApiUsageError(f"max_length must be a positive number of tokens, got {max_length!r}")
    if backbone_context is not None and max_length > backbone_context:
        raise ApiUsageError(f"max_length {max_length:,} is above the backbone's context of {backbone_context:,} "
                            f"tokens (max_position_embeddings); ask for at most {backbone_context:,}")
    return max_length


class PieceTokenizer(Protocol):
    """What the encoder needs from a tokenizer: ids of each piece, without special tokens added."""

    def encode_pieces(self, pieces: Sequence[str]) -> list[list[int]]: ...


@dataclass(frozen=True)
class EncodedQuestion:
    question_id: str
    question_type: int  # 0 noul, 1 choice, 2 score
    question_span: tuple[int, int]  # [start, end) in input_ids
    option_spans: tuple[tuple[int, int], ...]
    option_ids: tuple[str, ...]


MEDIA_ARRAYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


@dataclass(frozen=True, eq=False)
class MediaInputs:
    """What the processor made of a record's images and videos (docs/format.md §7): the ids that go right after
    the prefix, their modality (0 text, 1 image, 2 video), and the arrays the vision tower reads (numpy, so that no
    backend's framework is needed to hold them)."""

    token_ids: tuple[int, ...]
    mm_token_type_ids: tuple[int, ...]  # aligned with token_ids
    images: int
    videos: int
    pixel_values: Any = None  # float32 [image patches, C·T·P·P]
    image_grid_thw: Any = None  # int64 [images, 3]
    pixel_values_videos: Any = None  # float32 [video patches, C·T·P·P]
    video_grid_thw: Any = None  # int64 [videos, 3]
    token_offset: int = 0  # where token_ids start in the record's input_ids (the prefix's length)

    @property
    def visual_tokens(self) -> int:
        """Positions of the prompt that the vision tower fills (image and video pad tokens)."""
        return sum(1 for t in self.mm_token_type_ids if t)

    def arrays(self) -> dict[str, Any]:
        """The non-empty arrays by the model's argument names (``pixel_values``, ``image_grid_thw``, ...)."""
        return {name: getattr(self, name) for name in MEDIA_ARRAYS if getattr(self, name) is not None}

    @cached_property
    def digest(self) -> str:
        """SHA-256 of the ids, their modalities and every array's dtype, shape and bytes: equal digests mean
        equal backbone inputs (a cache key for the media part of a record)."""
        h = hashlib.sha256(json.dumps([self.token_ids, self.mm_token_type_ids, self.token_offset]).encode())
        for name, array in self.arrays().items():
            h.update(f"{name}:{array.dtype}:{tuple(array.shape)}".encode())
            h.update(memoryview(array).cast("B") if array.flags.c_contiguous else array.tobytes())
        return h.hexdigest()


@dataclass(frozen=True)
class EncodedRecord:
    """One request as the backbone and the head read it: token ids and spans, with the validated request it came
    from (its media resolved: docs/format.md §7), which the answers are built from."""

    input_ids: tuple[int, ...]
    questions: tuple[EncodedQuestion, ...]
    state_tokens: int  # state tokens kept
    truncated_tokens: int = 0  # state tokens dropped (only with truncate_state=True)
    state_start: int = 0  # position of the first state token (after the prefix and any media ids)
    media: MediaInputs | None = field(default=None, compare=False)  # images / videos, their ids after the prefix
    request: SystemOneRequest | None = field(default=None, compare=False, repr=False)


def render(value: Any) -> str:
    """A string as is; anything else as compact, key-sorted JSON that keeps non-ASCII characters."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def question_options(question: Question) -> list[tuple[str, Any]]:
    """The allowed options of a question as ``(option_id, description)`` in model order."""
    kind, criteria = question.type, question.criteria
    if kind == "noul":
        overrides = criteria if isinstance(criteria, dict) else {}
        return [(key, overrides[key] if key in overrides else NOUL_DEFAULTS[key]) for key in ("true", "false")]
    if kind == "choice" and isinstance(criteria, dict):
        return sorted((str(key), value) for key, value in criteria.items())
    if kind == "score" and isinstance(criteria, list):
        return [(str(level), text) for level, text in enumerate(criteria)]
    raise ApiUsageError(f"unknown question type {kind!r}; expected noul, choice or score")


def option_semantics(option_id: str, description: Any) -> str:
    semantics: dict[str, Any] = {"option_id": option_id}
    if description is not None:
        semantics["description"] = description
    return render(semantics)


class _Pieces:
    """Collects prompt pieces, tokenizing each distinct string once."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.index: dict[str, int] = {}
        self.sequence: list[int] = []

    def add(self, text: str) -> int:
        """Append a piece; returns its position in the sequence."""
        slot = self.index.get(text)
        if slot is None:
            slot = self.index[text] = len(self.order)
            self.order.append(text)
        self.sequence.append(slot)
        return len(self.sequence) - 1


def encode_request(
    tokenizer: PieceTokenizer,
    request: SystemOneRequest,
    *,
    max_length: int = REFERENCE_MAX_LENGTH,
    truncate_state: bool = False,
    media: MediaInputs | None = None,
) -> EncodedRecord:
    """Token ids and spans of one validated request (its ``state`` and ``questions``).

    ``media`` holds the processor's ids for the image/video placeholders, inserted right after the prefix (its
    visual tokens count against ``max_length``); the record carries it with its ``token_offset`` set.
    A state that does not fit ``max_length`` raises :class:`MaxTokensExceededError` unless ``truncate_state``,
    which keeps the state's first tokens as the reference does.
    """
    pieces = _Pieces()
    prefix, state, header = pieces.add(PREFIX), pieces.add(render(request.state)), pieces.add(SCHEMA_HEADER)
    # (question piece, [option pieces]) per question, by position in pieces.sequence
    layout: list[tuple[str, int, int, list[tuple[str, int]]]] = []
    for number, (question_id, question) in enumerate(request.questions.items(), start=1):
        pieces.add(f"\nFIELD {number}\nID: {question_id}\nTYPE: {question.type}\nINSTRUCTION: ")
        instructions = question.instructions
        if instructions is None or instructions == "":
            instructions = str(question_id)
        question_piece = pieces.add(render(instructions))
        pieces.add("\nALLOWED OPTIONS:\n")
        options = []
        for k, (option_id, description) in enumerate(question_options(question), start=1):
            pieces.add(f"OPTION {k}: ")
            options.append((option_id, pieces.add(option_semantics(option_id, description))))
            pieces.add("\n")
        pieces.add("END FIELD\n")
        layout.append((str(question_id), TYPE_IDS[question.type], question_piece, options))
    suffix = pieces.add(SUFFIX)

    ids_of = tokenizer.encode_pieces(pieces.order)
    piece_ids = [ids_of[slot] for slot in pieces.sequence]
    prefix_ids = list(piece_ids[prefix])
    if media is not None:
        media = replace(media, token_offset=len(prefix_ids))
        prefix_ids += media.token_ids
    state_ids = piece_ids[state]
    fixed = len(prefix_ids) + len(piece_ids[suffix]) + sum(len(piece_ids[i]) for i in range(header, suffix))
    if fixed > max_length:
        if media is None:
            what, hint = "prompt, questions and options without the state", "ask fewer questions or shorter options"
        else:
            what = (f"prompt, {media.visual_tokens} visual tokens of {_media_count(media)}, questions and options "
                    "without the state")
            hint = "send fewer or smaller images, or ask fewer questions or shorter options"
        raise MaxTokensExceededError(
            f"the schema alone needs {fixed} tokens ({what}); the context is {max_length}: {hint}",
            input_tokens=fixed,
            max_tokens=max_length,
        )
    truncated = max(0, len(state_ids) + fixed - max_length)
    if truncated and not truncate_state:
        schema = "schema" if media is None else f"schema with {media.visual_tokens} visual tokens"
        raise MaxTokensExceededError(
            f"state ({len(state_ids)} tokens) + {schema} ({fixed} tokens) = {len(state_ids) + fixed} tokens "
            f"exceed the context of {max_length}; shorten the state or pass truncate_state=True "
            f"to drop its last {truncated} tokens",
            input_tokens=len(state_ids) + fixed,
            max_tokens=max_length,
        )
    state_ids = state_ids[: len(state_ids) - truncated]

    input_ids: list[int] = prefix_ids + list(state_ids)
    starts: dict[int, int] = {}
    for position in range(header, suffix + 1):
        starts[position] = len(input_ids)
        input_ids.extend(piece_ids[position])

    def span(position: int) -> tuple[int, int]:
        return starts[position], starts[position] + len(piece_ids[position])

    questions = tuple(
        EncodedQuestion(
            question_id=qid,
            question_type=qtype,
            question_span=span(qpiece),
            option_spans=tuple(span(p) for _, p in options),
            option_ids=tuple(oid for oid, _ in options),
        )
        for qid, qtype, qpiece, options in layout
    )
    return EncodedRecord(tuple(input_ids), questions, state_tokens=len(state_ids), truncated_tokens=truncated,
                         state_start=len(prefix_ids), media=media, request=request)


def media_placeholder(images: int, videos: int) -> str:
    """The text whose processor ids go right after the prefix when a request carries media (before the processor
    expands each pad token to the image's or video's visual tokens)."""
    return IMAGE_PLACEHOLDER * images + VIDEO_PLACEHOLDER * videos + "\n"


def _media_count(media: MediaInputs) -> str:
    parts = [f"{n} {word}{'s' * (n != 1)}" for n, word in ((media.images, "image"), (media.videos, "video")) if n]
    return " and ".join(parts)
