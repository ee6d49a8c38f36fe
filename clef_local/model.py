"""The public runtime: ``load`` a release, then ``decide`` SystemOne requests, one at a time or batched."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from clef_local.backends.base import Backend, StateCachingBackend
from clef_local.errors import ApiUsageError, MaxTokensExceededError, ReleaseError
from clef_local.formats.release import HEAD_WEIGHTS, Release, read_release
from clef_local.runtime.answers import CONFIDENCE_MODES, Confidence, build_response, softmax_rows
from clef_local.runtime.assets import check_references, invalid
from clef_local.runtime.batching import device_pad_waste, split_by_length
from clef_local.runtime.encoding import (
    REFERENCE_MAX_LENGTH,
    EncodedRecord,
    encode_request,
    option_semantics,
    question_options,
)
from clef_local.runtime.head_reach import Reach, batch_reach, head_reach, record_reach
from clef_local.runtime.layout import build_layout
from clef_local.runtime.media import DEFAULT_MEDIA_LIMITS, MediaLimits, RequestMedia, resolve_media
from clef_local.runtime.processor import MediaProcessor
from clef_local.runtime.schema import DEFAULT_LIMITS, QUESTION_TYPES, Limits, request_to_record, validate_request
from clef_local.runtime.state_cache import StateCache, format_size, parse_size
from clef_local.runtime.tokenizer import ReleaseTokenizer

log = logging.getLogger(__name__)

CALIBRATION_KEY = "clef_local_calibration"  # config.json: {"temperatures": {"noul"|"choice"|"score": T}, ...}
OPTION_WRAPPER_BYTES = len(option_semantics("", None))  # '{"option_id":""}' around every option's label


def read_temperatures(config: dict[str, Any], where: str = "config.json") -> dict[str, float]:
    """Per-type softmax temperatures written by ``clef-local calibrate`` (empty: uncalibrated)."""
    entry = config.get(CALIBRATION_KEY)
    if entry is None:
        return {}
    temps = entry.get("temperatures") if isinstance(entry, dict) else None
    if not isinstance(temps, dict) or not all(
            k in QUESTION_TYPES and isinstance(v, int | float) and 0 < v < float("inf") for k, v in temps.items()):
        raise ReleaseError(f"{where}: {CALIBRATION_KEY}.temperatures must map noul/choice/score to positive "
                           f"numbers, got {temps!r}; rerun clef-local calibrate or remove the key")
    return {k: float(v) for k, v in temps.items()}


def _checked_confidence(mode: str) -> Confidence:
    if mode not in CONFIDENCE_MODES:
        raise ValueError(f"confidence must be one of {', '.join(CONFIDENCE_MODES)}, got {mode!r}")
    return cast(Confidence, mode)


@dataclass(frozen=True)
class Prediction:
    """One request's encoded form and per-question option probabilities (model order: sorted choice ids)."""

    record: dict[str, Any]
    encoded: EncodedRecord
    probabilities: list[np.ndarray]  # one float32 vector per question, aligned with encoded.questions

    def response(self, confidence: Confidence = "jev") -> dict[str, Any]:
        return build_response(self.record, self.encoded, self.probabilities, confidence)


def _state_cache(backend: Backend, budget: int, spill: int) -> StateCache:
    """The model's state cache: off (budget 0) on a backend or backbone that cannot continue a pass."""
    if spill and "cpu" in str(backend.device).lower():
        raise ApiUsageError(f"state_cache_spill is host memory for entries pushed off an accelerator; this model "
                            f"runs on {backend.device}, where the cache already lives in host memory: pass 0 and "
                            f"size state_cache instead")
    if budget and not isinstance(backend, StateCachingBackend):
        log.info("state cache: torch only; the %s backend runs every state in full", backend.name)
        budget = spill = 0
    elif budget and isinstance(backend, StateCachingBackend) and (why := backend.state_cache_blocker):
        log.info("state cache off: %s", why)
        budget = spill = 0
    return StateCache(budget, spill=spill)


class ClefModel:
    """A loaded Clef release. ``decide`` takes a ``/v1/systemone`` request body and returns its response.

    ``state_cache`` (bytes, 0: off) keeps what the backbone computed over each state (:mod:`clef_local.runtime.
    state_cache`), so another schema on the same state runs only its own tokens; ``state_cache_spill`` bytes of host
    memory take the entries pushed off an accelerator. :func:`load` sizes it with the planner.
    """

    def __init__(self, release: Release, backend: Backend, tokenizer: ReleaseTokenizer, *,
                 max_length: int | None = None, confidence: Confidence = "jev",
                 limits: Limits = DEFAULT_LIMITS, media_limits: MediaLimits = DEFAULT_MEDIA_LIMITS,
                 state_cache: int = 0, state_cache_spill: int = 0) -> None:
        self.release = release
        self.backend = backend
        self.tokenizer = tokenizer
        context = release.max_position_embeddings or REFERENCE_MAX_LENGTH
        # The reference's limit, lowered to the backbone's context when that is shorter.
        self.max_length = max_length or min(REFERENCE_MAX_LENGTH, context)
        self.confidence: Confidence = _checked_confidence(confidence)
        self.limits = limits
        self.media_limits = media_limits
        # images and videos (docs/format.md §7): the processors load on the first request that carries media
        self.media = (MediaProcessor(release.path, release.config, tokenizer, media_limits)
                      if release.has_vision else None)
        # logits are divided by their question type's temperature before the softmax (clef-local calibrate)
        self.temperatures = read_temperatures(release.config, str(release.path / "config.json"))
        # how much padding a batch may carry on this device (clef_local.runtime.batching): tight on a CPU
        self.pad_waste = device_pad_waste(backend.device)
        # how far the head reads a record decides how far the backbone runs (clef_local.runtime.head_reach); set it
        # to Reach.WHOLE_RECORD to run every record in full (the same numbers, for comparisons)
        self.reach: Reach = head_reach(release.path / HEAD_WEIGHTS)
        # the most bytes of text one token covers, read from the vocabulary once (check_size)
        self.max_token_bytes: int = tokenizer.max_token_bytes
        # per model: a model loaded again starts empty; clear() empties this one
        self.state_cache = _state_cache(backend, state_cache, state_cache_spill)

    @property
    def path(self) -> Path:
        return self.release.path

    def encode(self, request: Any, *, truncate_state: bool = False) -> tuple[dict[str, Any], EncodedRecord]:
        """Validate a request and encode it; raises the schema / media / max-tokens errors of
        :mod:`clef_local.errors`. Images and videos (the reference's ``images`` / ``videos``, Jev's ``assets``) are
        decoded and checked before the processor runs (docs/format.md §7)."""
        validated = validate_request(request, self.limits)
        record = request_to_record(validated)
        if not (record.get("images") or record.get("videos") or validated.assets is not None):
            check_references(record)
            self.check_size(record, truncate_state=truncate_state)  # 413 before tokenizing text that cannot fit
            return record, encode_request(self.tokenizer, record, max_length=self.max_length,
                                          truncate_state=truncate_state)
        self.media_processor()  # refused before anything is decoded when this model cannot read media
        media = resolve_media(record, validated.assets, limits=self.media_limits)
        self.check_size(media.record, truncate_state=truncate_state)  # the text as encoded: assets' markers in place
        return media.record, self.encode_media(media, truncate_state=truncate_state)

    def media_processor(self) -> MediaProcessor:
        """The release's media processor; ``ApiUsageError`` (400) when this model cannot read images here: no
        vision tower, or a backend other than torch."""
        if self.media is None:
            raise ApiUsageError(f"{self.release.path.name} has no vision tower ({self.release.architecture}): it "
                                "reads text and JSON states only; send the request without images or videos")
        if not getattr(self.backend, "accepts_media", False):
            raise ApiUsageError(f"the {self.backend.name} backend does not run the vision tower; load the model with "
                                "--backend torch (backend=\"torch\") to send images or videos")
        return self.media

    def encode_media(self, media: RequestMedia, *, truncate_state: bool = False) -> EncodedRecord:
        """Encode a record whose media :func:`~clef_local.runtime.media.resolve_media` decoded."""
        inputs = self.media_processor().encode(media.images, media.videos, max_tokens=self.max_length)
        encoded = encode_request(self.tokenizer, media.record, max_length=self.max_length,
                                 truncate_state=truncate_state, media=inputs)
        # The vision tower fills exactly the media's pad tokens: a pad token typed into the text would shift them.
        stray = sum(1 for t in encoded.input_ids if t in self._pad_ids) - inputs.visual_tokens
        if stray:
            raise invalid([], "the state or the questions contain the vision placeholder tokens <|image_pad|> or "
                              "<|video_pad|> as text; remove them from a request with images or videos",
                          "vision_token_in_text")
        return encoded

    @property
    def _pad_ids(self) -> frozenset[int]:
        ids = (self.release.config.get("image_token_id"), self.release.config.get("video_token_id"))
        return frozenset(i for i in ids if isinstance(i, int))

    def check_size(self, request: Any, *, truncate_state: bool = False) -> int:
        """Refuse, without tokenizing it, a validated request whose text cannot fit the context; else return the
        lower bound on its prompt's tokens that it was checked with.

        No token covers more than ``self.max_token_bytes`` bytes of text, so each prompt piece (docs/format.md §2)
        needs at least ``ceil(bytes / max_token_bytes)`` tokens, and at least one when it is not empty. When one
        field alone (the state, a question id, instructions, an option) or all of them together need more than
        ``self.max_length`` tokens by that count, :class:`MaxTokensExceededError` (HTTP 413) names the field at
        once: tokenizing a 10 MB field only to fail would hold the inference thread for seconds and grow the
        process by gigabytes. ``encode`` calls it; the server calls it before queueing. With ``truncate_state``
        the state is left out (it is cut to fit).
        """
        fields = list(text_fields(request, include_state=not truncate_state))
        per_token = self.max_token_bytes
        # the pieces of template text alone, one token at least each: the prompt's prefix, schema header and suffix;
        # per question "ALLOWED OPTIONS" and "END FIELD"; per option "OPTION k: " and its newline
        total = 3
        for question in request["questions"].values():
            total += 2 + 2 * len(question_options(question))
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

    def predict(self, requests: Sequence[Any], *, truncate_state: bool = False, batch_size: int = 8,
                progress: Callable[[int, int], None] | None = None,
                batch_seconds: list[float] | None = None) -> list[Prediction]:
        """Probabilities for each request (in request order), run in padded batches of similar lengths.

        ``progress(done, total)`` is called after each batch; ``batch_seconds``, when given, receives each batch's
        wall time (backbone and head; validation and encoding excluded). See :meth:`predict_batches` for how
        batches are cut.
        """
        encoded = [self.encode(r, truncate_state=truncate_state) for r in requests]
        return self.predict_encoded(encoded, batch_size=batch_size, progress=progress, batch_seconds=batch_seconds)

    def predict_encoded(self, encoded: Sequence[tuple[dict[str, Any], EncodedRecord]], *, batch_size: int = 8,
                        progress: Callable[[int, int], None] | None = None,
                        batch_seconds: list[float] | None = None) -> list[Prediction]:
        """:meth:`predict` for requests that went through :meth:`encode` already (``(record, encoded)`` pairs).

        Lets a caller validate and tokenize on another thread while the backbone runs (``clef-local batch``), and
        keep a bad request's error to itself instead of failing the whole list.
        """
        results: list[Prediction | None] = [None] * len(encoded)
        done = 0
        batches = self.encoded_batches(encoded, batch_size=batch_size)
        began = time.perf_counter()
        for chunk, predictions in batches:
            if batch_seconds is not None:
                batch_seconds.append(time.perf_counter() - began)
            for i, prediction in zip(chunk, predictions, strict=True):
                results[i] = prediction
            done += len(chunk)
            if progress is not None:
                progress(done, len(encoded))
            began = time.perf_counter()
        return [r for r in results if r is not None]

    def predict_batches(self, requests: Sequence[Any], *, truncate_state: bool = False, batch_size: int = 8
                        ) -> Iterator[tuple[list[int], list[Prediction]]]:
        """``(request indices, their predictions)`` for each batch as it finishes (for progress and timing).

        Every request is validated and encoded first (so a bad one raises before any batch runs). Batches hold up
        to ``batch_size`` requests sorted by token count, cut where padding would cost more than
        ``self.pad_waste`` times the rows' own tokens (:mod:`clef_local.runtime.batching`): on a CPU, where padding
        is pure loss, only equal lengths share one.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        encoded = [self.encode(r, truncate_state=truncate_state) for r in requests]
        return self.encoded_batches(encoded, batch_size=batch_size)

    def encoded_batches(self, encoded: Sequence[tuple[dict[str, Any], EncodedRecord]], *, batch_size: int = 8
                        ) -> Iterator[tuple[list[int], list[Prediction]]]:
        """:meth:`predict_batches` for ``(record, encoded)`` pairs from :meth:`encode` (the same batches)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        chunks = split_by_length([self._backbone_positions(e[1]) for e in encoded], self.pad_waste,
                                 max_size=batch_size)

        def run() -> Iterator[tuple[list[int], list[Prediction]]]:
            for chunk in chunks:
                probs = self._probabilities([encoded[i][1] for i in chunk])
                yield chunk, [Prediction(*encoded[i], p) for i, p in zip(chunk, probs, strict=True)]

        return run()

    def _backbone_positions(self, record: EncodedRecord) -> int:
        return record_reach(record, self.reach)

    def _probabilities(self, records: list[EncodedRecord]) -> list[list[np.ndarray]]:
        layout = build_layout(records, max(len(r.input_ids) for r in records))
        started = time.perf_counter()
        reach = None if self.reach is Reach.WHOLE_RECORD else batch_reach(records, self.reach)
        if self.state_cache.enabled and isinstance(self.backend, StateCachingBackend):
            logits = self.backend.cached_logits(records, layout, self.tokenizer.pad_token_id, self.state_cache,
                                                reach=reach)
        else:
            logits = self.backend.logits(records, layout, self.tokenizer.pad_token_id, reach=reach)
        if self.temperatures:
            temps = [self.temperatures.get(QUESTION_TYPES[q.question_type], 1.0) for r in records for q in r.questions]
            logits = logits / np.asarray(temps, dtype=np.float32)[:, None]
        probs = softmax_rows(logits)
        log.debug("%d records, %d questions in %.1f ms", len(records), layout.num_questions,
                  1e3 * (time.perf_counter() - started))
        out: list[list[np.ndarray]] = []
        row = 0
        for record in records:
            out.append([probs[row + i, : len(q.option_ids)] for i, q in enumerate(record.questions)])
            row += len(record.questions)
        return out

    def decide(self, request: Any, *, confidence: Confidence | None = None,
               truncate_state: bool = False) -> dict[str, Any]:
        """Answer one ``/v1/systemone`` request body (a dict); floats keep full precision."""
        return self.decide_batch([request], confidence=confidence, truncate_state=truncate_state)[0]

    def decide_batch(self, requests: Sequence[Any], *, confidence: Confidence | None = None,
                     truncate_state: bool = False, batch_size: int = 8) -> list[dict[str, Any]]:
        """Answer several requests in padded batches; the same numbers as one by one (within float noise)."""
        mode = _checked_confidence(confidence or self.confidence)
        predictions = self.predict(requests, truncate_state=truncate_state, batch_size=batch_size)
        return [p.response(mode) for p in predictions]

    def _media_description(self) -> dict[str, Any] | str:
        if self.media is None:
            return "none (no vision tower)"
        if not getattr(self.backend, "accepts_media", False):
            return f"not on the {self.backend.name} backend (--backend torch)"
        from clef_local.runtime.processor import video_unavailable

        g = self.media.geometry
        return {"images": "accepted", "videos": video_unavailable() or "accepted",
                "max_images": self.media_limits.max_images,
                "pixels_per_image": [g.min_pixels, self.media_limits.max_pixels or g.max_pixels],
                "patch": g.patch, "merge": g.merge}

    def describe(self) -> dict[str, Any]:
        """What ``clef-local inspect`` prints: backbone, sizes, head config, dtype, context."""
        release = self.release
        return {
            "path": str(release.path),
            "architecture": release.architecture,
            "hidden_size": release.hidden_size,
            "vision_tower": release.has_vision,
            "media": self._media_description(),
            "context": self.max_length,
            "weight_files": [f.name for f in release.weight_files],
            "weight_bytes": release.weight_bytes,
            "quantization": release.quantization,
            "head_config": release.head_config.to_json_dict(),
            "tokenizer_vocab": self.tokenizer.vocab_size,
            "confidence": self.confidence,
            "backbone_pass": self.reach.value,
            "state_cache": {"budget_bytes": self.state_cache.budget, "spill_bytes": self.state_cache.spill},
            **self.backend.describe(),
            **({"loader": decision.to_json()} if (decision := self.backend.load_decision) else {}),
        }


def text_fields(request: Any, *, include_state: bool = True) -> Iterator[tuple[str, int]]:
    """``(name, bytes)`` of each piece of a validated request's prompt that holds its text (docs/format.md §2).

    Bytes are a lower bound on the rendered piece's UTF-8 size (:func:`text_bytes`); a question id counts twice
    when it stands in for missing instructions, as in the prompt. Names are shortened for messages.
    """
    if include_state:
        yield "the state", text_bytes(request["state"])
    for question_id, question in request["questions"].items():
        where = f"question {_short(question_id)!r}"
        id_bytes = text_bytes(question_id)
        yield f"the id of {where}", id_bytes
        instructions = question.get("instructions")
        missing = instructions is None or instructions == ""
        yield f"the instructions of {where}", id_bytes if missing else text_bytes(instructions)
        for option_id, description in question_options(question):
            described = 0 if description is None else text_bytes(description)
            size = OPTION_WRAPPER_BYTES + text_bytes(option_id) + described
            yield f"option {_short(option_id)!r} of {where}", size


def text_bytes(value: Any) -> int:
    """At most the UTF-8 size of ``value`` rendered as the prompt renders it, without rendering it.

    A string's own bytes; for an object or array, the bytes of every key and string in it plus one per other value
    (JSON adds quotes, separators and escapes, never removes). Iterative, so any nesting depth is fine.
    """
    if isinstance(value, str):
        return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
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


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def load(path: str | Path, *, device: str = "auto", dtype: str | None = None, backend: str = "auto",
         max_length: int | None = None, confidence: Confidence = "jev",
         limits: Limits = DEFAULT_LIMITS, max_memory: str | dict[str, Any] | None = None,
         media_limits: MediaLimits = DEFAULT_MEDIA_LIMITS, state_cache: int | str | None = None,
         state_cache_spill: int | str = 0) -> ClefModel:
    """Load a Clef release (or variant) directory.

    ``backend`` is ``"auto"``, ``"torch"``, ``"mlx"`` or ``"onnx"`` and ``device`` ``"auto"``, ``"cpu"``, ``"cuda"``
    (``"cuda:N"``), ``"mps"``, or several (``"cuda:0,cuda:1"``: the decoder layers split over them, torch only);
    :mod:`clef_local.planning.choice` decides what ``"auto"`` means on this machine. ``max_memory`` caps devices
    (``{"cuda:0": "24GiB"}``, ``"cuda:0=24GiB"``, or ``"24GiB"`` for every device): a model that does not fit under
    the cap is refused before loading, and on CUDA the allocator is capped too (docs/hardware.md).
    ``dtype`` is the backbone's compute dtype (``None``: as stored, BF16 for real releases; ``"float32"`` for
    exact comparisons); the joint schema head always runs in float32. ``max_length`` defaults to the smaller of
    the reference's 16,384 and the backbone's context. ``media_limits`` bounds the images and videos a request may
    carry (:class:`~clef_local.runtime.media.MediaLimits`).

    ``state_cache``: bytes or a size (``"512MiB"``, ``"2GiB"``) for the cache of states (a second schema on the same
    state runs only its own tokens; torch only), ``0`` to turn it off; ``None``/``"auto"``: sized by the planner from
    the memory the model leaves free (:mod:`clef_local.planning.estimate`). ``state_cache_spill``: host memory for
    entries pushed off a GPU (0: they are dropped).
    """
    from clef_local.backends.loader import build_backend

    cache_budget, spill = parse_size(state_cache), parse_size(state_cache_spill) or 0
    release = read_release(path)
    started = time.perf_counter()
    runner = build_backend(release, backend=backend, device=device, dtype=dtype, max_memory=max_memory,
                           state_cache=cache_budget)
    if runner.load_decision is not None:
        cache_budget = runner.load_decision.state_cache_bytes
    model = ClefModel(release, runner, ReleaseTokenizer(release.path), max_length=max_length,
                      confidence=confidence, limits=limits, media_limits=media_limits, state_cache=cache_budget or 0,
                      state_cache_spill=spill)
    cache = model.state_cache
    log.info("state cache: %s", "off" if not cache.enabled else format_size(cache.budget)
             + (" (sized by the planner)" if state_cache in (None, "auto") else "")
             + (f" + {format_size(cache.spill)} of host memory" if cache.spill else ""))
    log.info("loaded %s in %.1f s", release.path, time.perf_counter() - started)
    return model
