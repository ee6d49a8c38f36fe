"""The public runtime: ``load`` a release, then ``decide`` SystemOne requests, one at a time or batched.

Every request takes one path: :meth:`ClefModel.encode` (:mod:`.runtime.encoder`), then :meth:`ClefModel.run`, the
one generator that batches encoded records, runs the backend and turns logits into probabilities; ``decide``,
``decide_batch``, ``predict``, the server, ``batch``, ``eval`` and ``drift`` all go through it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from clef_local.backends.base import Backend
from clef_local.errors import ApiUsageError, ReleaseError
from clef_local.formats.release import Release, read_release
from clef_local.formats.variant import variant_format
from clef_local.planning.load_options import LoadOptions
from clef_local.runtime.answers import CONFIDENCE_MODES, Confidence, build_response, softmax_rows
from clef_local.runtime.batching import device_pad_waste, split_by_length
from clef_local.runtime.encoder import MediaSupport, RequestEncoder
from clef_local.runtime.encoding import EncodedRecord, checked_max_length
from clef_local.runtime.layout import build_layout
from clef_local.runtime.media import DEFAULT_MEDIA_LIMITS, MediaLimits
from clef_local.runtime.processor import MediaProcessor
from clef_local.runtime.schema import DEFAULT_LIMITS, QUESTION_TYPES, Limits, SystemOneRequest
from clef_local.runtime.state_cache import StateCache, parse_size, record_state_key
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.units import format_size

log = logging.getLogger(__name__)

# config.json: {"temperatures": {"noul"|"choice"|"score": T}, "thresholds": {type: {"threshold": t, ...}}, ...}
CALIBRATION_KEY = "clef_local_calibration"
Request = Mapping[str, Any] | SystemOneRequest  # a request body as decoded JSON, or already validated


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


def read_thresholds(config: dict[str, Any], where: str = "config.json") -> dict[str, float]:
    """Per-type confidence thresholds written by ``clef-local calibrate --error-budget`` (empty: none stored, as in
    every file written before they existed). A question whose top probability is under its type's threshold is one
    the model should not be trusted on (``batch`` marks it); a stored ``null`` (no threshold kept the error within
    the budget) marks every question of that type, so it reads as infinity."""
    entry = config.get(CALIBRATION_KEY)
    stored = entry.get("thresholds") if isinstance(entry, dict) else None
    if stored is None:
        return {}
    out: dict[str, float] = {}
    if isinstance(stored, dict):
        for kind, value in stored.items():
            t = value.get("threshold", "missing") if isinstance(value, dict) else "missing"
            if kind in QUESTION_TYPES and t is None:
                out[kind] = float("inf")
            elif kind in QUESTION_TYPES and isinstance(t, int | float) and 0 <= t <= 1:
                out[kind] = float(t)
            else:
                break
        else:
            return out
    raise ReleaseError(f"{where}: {CALIBRATION_KEY}.thresholds must map noul/choice/score to {{\"threshold\": a "
                       f"probability or null, ...}}, got {stored!r}; rerun clef-local calibrate --error-budget or "
                       "remove the key")


def _checked_confidence(mode: str) -> Confidence:
    if mode not in CONFIDENCE_MODES:
        raise ValueError(f"confidence must be one of {', '.join(CONFIDENCE_MODES)}, got {mode!r}")
    return cast(Confidence, mode)


@dataclass(frozen=True)
class Prediction:
    """One request's encoded form and per-question option probabilities (model order: sorted choice ids)."""

    encoded: EncodedRecord
    probabilities: list[np.ndarray]  # one float32 vector per question, aligned with encoded.questions

    @property
    def request(self) -> SystemOneRequest:
        """The validated request (media resolved) this prediction answers."""
        if self.encoded.request is None:
            raise ValueError("a Prediction needs an EncodedRecord made by ClefModel.encode")
        return self.encoded.request

    def response(self, confidence: Confidence = "jev") -> dict[str, Any]:
        return build_response(self.encoded, self.probabilities, confidence)


def _state_cache(backend: Backend, budget: int, spill: int) -> StateCache:
    """The model's state cache: off (budget 0) on a backend or backbone that cannot continue a pass."""
    if spill and "cpu" in str(backend.device).lower():
        raise ApiUsageError(f"state_cache_spill is host memory for entries pushed off an accelerator; this model "
                            f"runs on {backend.device}, where the cache already lives in host memory: pass 0 and "
                            f"size state_cache instead")
    if budget and (why := backend.state_cache_blocker):
        log.info("state cache off: %s", why)
        budget = spill = 0
    return StateCache(budget, spill=spill)


def _media_support(release: Release, backend: Backend, tokenizer: ReleaseTokenizer,
                   limits: MediaLimits) -> MediaSupport:
    if not release.has_vision:
        return MediaSupport(None, f"{release.path.name} has no vision tower ({release.architecture}): it reads "
                                  "text and JSON states only; send the request without images or videos")
    processor = MediaProcessor(release.path, release.config, tokenizer, limits)  # loads on first use
    if not backend.accepts_media and backend.media_refusal:
        return MediaSupport(processor, backend.media_refusal)  # its own reason (llamacpp: no vision.safetensors, ...)
    if not backend.accepts_media:
        # a backend without the vision tower (ONNX, MLX): torch runs it; a GGUF release's source release, if any
        how = ("load its source release (safetensors) with --backend torch (backend=\"torch\")" if release.is_gguf
               else "load the model with --backend torch (backend=\"torch\")")
        return MediaSupport(processor, f"the {backend.name} backend does not run the vision tower; {how} to send "
                                       "images or videos")
    return MediaSupport(processor)


def _precision_groups(release: Release) -> list[dict[str, Any]]:
    """A mixed variant's layer groups with their formats and stored bytes (``inspect``), else empty."""
    from clef_local.planning.census import census_from_release, precision_groups, stored_format

    if stored_format(release.config) != "mixed":
        return []
    return precision_groups(release.config, census_from_release(release.path, release.weight_files, release.config))


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
        pad_ids = frozenset(v for k in ("image_token_id", "video_token_id")
                            if isinstance(v := release.config.get(k), int))
        self.encoder = RequestEncoder(
            tokenizer, max_length=checked_max_length(max_length, release.max_position_embeddings), limits=limits,
            media=_media_support(release, backend, tokenizer, media_limits), media_limits=media_limits,
            pad_ids=pad_ids)
        self.confidence: Confidence = _checked_confidence(confidence)
        # logits are divided by their question type's temperature before the softmax (clef-local calibrate)
        self.temperatures = read_temperatures(release.config, str(release.path / "config.json"))
        # a question under its type's confidence threshold is marked by `batch` (clef-local calibrate --error-budget)
        self.thresholds = read_thresholds(release.config, str(release.path / "config.json"))
        # how much padding a batch may carry on this device (clef_local.runtime.batching): tight on a CPU; a
        # backend streamed from disk asks for more padding and batches of its own size (Backend.batch_tokens)
        self.pad_waste = backend.pad_waste or device_pad_waste(backend.device)
        self.batch_tokens = backend.batch_tokens
        # per model: a model loaded again starts empty; clear() empties this one
        self.state_cache = _state_cache(backend, state_cache, state_cache_spill)

    @property
    def path(self) -> Path:
        return self.release.path

    @property
    def max_length(self) -> int:
        """The context a request must fit, in tokens."""
        return self.encoder.max_length

    @property
    def limits(self) -> Limits:
        return self.encoder.limits

    @property
    def media_limits(self) -> MediaLimits:
        return self.encoder.media_limits

    def encode(self, request: Request, *, truncate_state: bool = False,
               parts: Mapping[str, bytes] | None = None) -> EncodedRecord:
        """Validate a request and encode it (:class:`~clef_local.runtime.encoder.RequestEncoder`); raises the
        schema / size / media errors of :mod:`clef_local.errors`, and :class:`~clef_local.errors.RequestMemoryError`
        (413) for a request within the context whose backbone pass the memory left cannot hold
        (:mod:`clef_local.planning.prefill`). ``parts``: a multipart body's parts."""
        record = self.encoder.encode(request, truncate_state=truncate_state, parts=parts)
        if self.backend.prefill is not None:
            self.backend.prefill.check(len(record.input_ids), self.max_length)
        return record

    def state_digest(self, record: EncodedRecord) -> str:
        """The name of ``record``'s state for this loaded model (64 hex digits): SHA-256 of the model's identity
        (release files, backend, device, compute dtype), the token ids of prefix + media + state and the media's
        digest (:func:`~clef_local.runtime.state_cache.record_state_key`). Equal digests mean the same state of the
        same model; on the torch backend it is the key the state cache keeps that state under."""
        return record_state_key(self.backend.state_identity, record)

    def run(self, records: Sequence[EncodedRecord], *, batch_size: int = 8
            ) -> Iterator[tuple[list[int], list[Prediction]]]:
        """``(record indices, their predictions)`` for each batch as it finishes: the one way encoded records run.

        Batches hold up to ``batch_size`` records sorted by length, cut where padding would cost more than
        ``self.pad_waste`` times the rows' own tokens (:mod:`clef_local.runtime.batching`): on a CPU, where padding
        is pure loss, only equal lengths share one; and cut again to the rows whose prefill fits the memory left
        (:meth:`PrefillBudget.rows <clef_local.planning.prefill.PrefillBudget.rows>`). A backend streamed from disk
        reads every layer once per batch: its batches hold as many records as ``self.batch_tokens`` padded tokens
        allow, whatever ``batch_size``.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        cache = self.state_cache if self.state_cache.enabled else None
        for chunk in self._batches(records, batch_size):
            batch = [records[i] for i in chunk]
            layout = build_layout(batch, max(len(r.input_ids) for r in batch))
            logits = self.backend.logits(batch, layout, self.tokenizer.pad_token_id, cache)
            if self.temperatures:
                temps = [self.temperatures.get(QUESTION_TYPES[q.question_type], 1.0)
                         for r in batch for q in r.questions]
                logits = logits / np.asarray(temps, dtype=np.float32)[:, None]
            probs, row, predictions = softmax_rows(logits), 0, []
            for record in batch:
                predictions.append(Prediction(record, [probs[row + i, : len(q.option_ids)]
                                                       for i, q in enumerate(record.questions)]))
                row += len(record.questions)
            yield chunk, predictions

    def _batches(self, records: Sequence[EncodedRecord], batch_size: int) -> Iterator[list[int]]:
        """:func:`split_by_length`'s batches, each cut into runs of as many rows as one prefill may hold."""
        prefill = self.backend.prefill
        size = batch_size if self.batch_tokens is None else None
        for group in split_by_length([len(r.input_ids) for r in records], self.pad_waste, max_size=size,
                                     max_padded=self.batch_tokens):
            rows = len(group)
            if prefill is not None and rows > 1:
                rows = prefill.rows(max(len(records[i].input_ids) for i in group), rows)
            for start in range(0, len(group), rows):
                yield group[start:start + rows]

    def predict(self, requests: Sequence[Request], *, truncate_state: bool = False, batch_size: int = 8,
                progress: Callable[[int, int], None] | None = None,
                batch_seconds: list[float] | None = None) -> list[Prediction]:
        """Probabilities for each request, in request order. Every request is encoded first, so a bad one raises
        before any batch runs. ``progress(done, total)`` is called after each batch; ``batch_seconds``, when
        given, receives each batch's wall time (backbone and head; encoding excluded)."""
        records = [self.encode(r, truncate_state=truncate_state) for r in requests]
        results: list[Prediction | None] = [None] * len(records)
        done, began = 0, time.perf_counter()
        for chunk, predictions in self.run(records, batch_size=batch_size):
            if batch_seconds is not None:
                batch_seconds.append(time.perf_counter() - began)
            for i, prediction in zip(chunk, predictions, strict=True):
                results[i] = prediction
            done += len(chunk)
            if progress is not None:
                progress(done, len(records))
            began = time.perf_counter()
        return cast(list[Prediction], results)

    def decide(self, request: Request, *, confidence: Confidence | None = None,
               truncate_state: bool = False) -> dict[str, Any]:
        """Answer one ``/v1/systemone`` request body; floats keep full precision."""
        mode = _checked_confidence(confidence or self.confidence)
        [(_, [prediction])] = self.run([self.encode(request, truncate_state=truncate_state)])
        return prediction.response(mode)

    def decide_batch(self, requests: Sequence[Request], *, confidence: Confidence | None = None,
                     truncate_state: bool = False, batch_size: int = 8) -> list[dict[str, Any]]:
        """Answer several requests in padded batches; the same numbers as one by one (within float noise)."""
        mode = _checked_confidence(confidence or self.confidence)
        return [p.response(mode) for p in self.predict(requests, truncate_state=truncate_state,
                                                         batch_size=batch_size)]

    def _media_description(self) -> dict[str, Any] | str:
        media = self.encoder.media
        if media.processor is None or media.refusal is not None:
            return "none (no vision tower)" if media.processor is None else \
                f"not on the {self.backend.name} backend (--backend torch)"
        from clef_local.runtime.processor import video_unavailable

        g = media.processor.geometry
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
            # the stored format and the tool that wrote it (clef-local, mlx-lm, compressed-tensors, bitsandbytes)
            "format": fmt.to_json() if (fmt := variant_format(release.config)) else None,
            "quantization": release.quantization,
            **({"precision_groups": groups} if (groups := _precision_groups(release)) else {}),
            "head_config": release.head_config.to_json_dict(),
            "tokenizer_vocab": self.tokenizer.vocab_size,
            "confidence": self.confidence,
            "state_cache": {"budget_bytes": self.state_cache.budget, "spill_bytes": self.state_cache.spill},
            **({"prefill": prefill.describe(self.max_length)} if (prefill := self.backend.prefill) else {}),
            **self.backend.describe(),
            **({"loader": decision.to_json()} if (decision := self.backend.load_decision) else {}),
        }


def load(path: str | Path | Release, *, device: str = "auto", dtype: str | None = None, backend: str = "auto",
         max_length: int | None = None, confidence: Confidence = "jev",
         limits: Limits = DEFAULT_LIMITS, max_memory: str | dict[str, Any] | None = None,
         media_limits: MediaLimits = DEFAULT_MEDIA_LIMITS, state_cache: int | str | None = 0,
         state_cache_spill: int | str = 0, prefill_chunk: int | None = None, offload: str = "none") -> ClefModel:
    """Load a Clef release (or variant) directory, or a :class:`~clef_local.formats.release.Release` already read
    (its identity was checked when it was read: it is not read again).

    ``backend`` is ``"auto"``, ``"torch"``, ``"mlx"``, ``"onnx"`` or ``"llamacpp"`` (a GGUF release, which ``auto``
    runs on llama.cpp, the only backend that can) and ``device`` ``"auto"``, ``"cpu"``, ``"cuda"``
    (``"cuda:N"``), ``"mps"``, or several (``"cuda:0,cuda:1"``: the decoder layers split over them, torch only);
    :mod:`clef_local.planning.choice` decides what ``"auto"`` means on this machine. ``max_memory`` caps devices
    (``{"cuda:0": "24GiB"}``, ``"cuda:0=24GiB"``, or ``"24GiB"`` for every device): a model that does not fit under
    the cap is refused before loading, and on CUDA the allocator is capped too (docs/hardware.md).
    ``dtype`` is the backbone's compute dtype (``None``: as stored, BF16 for real releases; ``"float32"`` for
    exact comparisons); the joint schema head always runs in float32. ``max_length``, the longest request in tokens,
    defaults to the smaller of 65,536 (the window Clef is published with) and the backbone's context, and may be
    anything up to the backbone's context (above it: ``ApiUsageError``). The planner counts memory at it: an asked
    ``max_length`` that does not fit is refused (``InsufficientMemoryError``); the default, when it does not fit,
    is planned at 16,384 tokens instead (a warning), and a request whose pass does not fit the memory left is refused
    when it is encoded (``RequestMemoryError``, 413). A pass that does not fit in one piece runs in chunks
    (chunked prefill, torch; the planner picks the chunk length, ``prefill_chunk`` forces one: a multiple of 64, 0
    for one pass; docs/hardware.md#chunked-prefill). ``media_limits`` bounds the images and videos a request may
    carry (:class:`~clef_local.runtime.media.MediaLimits`).

    ``state_cache``: bytes or a size (``"512MiB"``, ``"2GiB"``) for the cache of states (a second schema on the same
    state runs only its own tokens; torch only); ``None``/``"auto"``: sized by the planner from the memory the model
    leaves free (:mod:`clef_local.planning.estimate`); ``0`` (the default) keeps none, so a cold request runs the
    backbone once: pass a size where the same state comes back (``serve``, ``mcp`` and ``ui`` size theirs).
    ``state_cache_spill``: host memory for entries pushed off a GPU (0: they are dropped).

    ``offload``: ``"none"`` (the default) holds the backbone in memory and refuses one that does not fit; ``"disk"``
    streams it from its safetensors files a decoder layer at a time (torch only; slow: every batch reads every
    layer, docs/hardware.md#streamed-from-disk); ``"auto"`` streams only what does not fit resident (what the
    reference runs of ``drift``, ``eval``, ``calibrate`` and export validation use).
    """
    options = LoadOptions(device=device, dtype=dtype, backend=backend, max_length=max_length, confidence=confidence,
                          limits=limits, max_memory=max_memory, media_limits=media_limits,
                          state_cache=parse_size(state_cache), state_cache_spill=parse_size(state_cache_spill) or 0,
                          prefill_chunk=prefill_chunk, offload=offload)
    return _load(path if isinstance(path, Release) else read_release(path), options)


def _load(release: Release, options: LoadOptions) -> ClefModel:
    from clef_local.backends.loader import build_backend

    context = checked_max_length(options.max_length, release.max_position_embeddings)
    started = time.perf_counter()
    runner = build_backend(release, options)
    cache_budget = options.state_cache
    if runner.load_decision is not None:
        cache_budget = runner.load_decision.state_cache_bytes
    model = ClefModel(release, runner, ReleaseTokenizer(release.path), max_length=context,
                      confidence=options.confidence, limits=options.limits, media_limits=options.media_limits,
                      state_cache=cache_budget or 0, state_cache_spill=options.state_cache_spill)
    cache = model.state_cache
    log.info("state cache: %s", "off" if not cache.enabled else format_size(cache.budget)
             + (" (sized by the planner)" if options.state_cache is None else "")
             + (f" + {format_size(cache.spill)} of host memory" if cache.spill else ""))
    log.info("loaded %s in %.1f s", release.path, time.perf_counter() - started)
    return model
