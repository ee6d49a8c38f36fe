"""A reference run once and kept: ``drift --save-reference FILE`` writes the reference's probabilities on its request
set; ``drift --reference-file FILE`` and ``quantize --reference-file FILE`` compare variants with them without
loading the reference, on this machine or another (the air-gapped case). docs/quality.md#reference-files.

The file (JSON, ``clef-local-reference/1``) records what makes two runs comparable, and every check refuses a
mismatch in one line naming it (:class:`ReferenceFileError`): the reference's identity (the digest of its manifest's
file list, :func:`clef_local.formats.manifest.release_digest`, which a variant's manifest records as its source),
the requests' hash, the compute dtype, the context, and per request the digest of its token ids and its questions
and options. ``content_sha256`` covers all of it: a file edited by hand or damaged is refused. It is a checksum,
not a signature: whoever can edit the file can also recompute it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clef_local.errors import ClefError

if TYPE_CHECKING:
    from clef_local.model import Prediction

FORMAT = "clef-local-reference/1"
MAKE = "clef-local drift --reference DIR --save-reference FILE"


class ReferenceFileError(ClefError):
    """A reference file that cannot be used here: unreadable, edited, or made for other requests, another reference,
    dtype or context (the message names which and how to make a matching one)."""


def canonical(value: Any) -> bytes:
    """The bytes every digest here is taken over: JSON with sorted keys, no spaces, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def requests_digest(requests: Sequence[Mapping[str, Any]]) -> str:
    """SHA-256 of the request list as canonical JSON."""
    return hashlib.sha256(canonical(list(requests))).hexdigest()


def tokens_digest(ids: Sequence[int]) -> str:
    """SHA-256 of a record's token ids (little-endian int64)."""
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class ReferenceFile:
    """A reference's probabilities on a request set, and what they were computed from."""

    reference: dict[str, Any]  # {"path", "digest", "head": {file: sha256}}
    dtype: str
    context: int
    requests_sha256: str
    truncate_state: bool
    records: list[dict[str, Any]]  # per request: {"tokens_sha256", "questions": [{"id", "options", "p"}]}
    meta: dict[str, Any] = field(default_factory=dict)  # backend, device, created, tool, data: shown, not checked
    path: Path | None = None

    def content(self) -> dict[str, Any]:
        return {"format": FORMAT, "reference": self.reference, "dtype": self.dtype, "context": self.context,
                "requests": {"count": len(self.records), "sha256": self.requests_sha256},
                "truncate_state": self.truncate_state, "meta": self.meta, "records": self.records}

    @property
    def name(self) -> str:
        return str(self.path) if self.path else "the reference file"

    def describe(self) -> str:
        """"clef-flash (digest 1a2b3c4d5e6f), bfloat16, context 16,384, 64 requests, torch on cpu, 2026-12-03"."""
        when = str(self.meta.get("created", ""))[:10]
        where = f"{self.meta.get('backend', '?')} on {self.meta.get('device', '?')}"
        return (f"{self.reference['path']} (digest {self.reference['digest'][:12]}), {self.dtype}, context "
                f"{self.context:,}, {len(self.records)} requests, {where}, {when}")


def from_predictions(predictions: Sequence[Prediction], requests: Sequence[Mapping[str, Any]], *,
                     reference_dir: str | Path, dtype: str, context: int, truncate_state: bool = False,
                     meta: Mapping[str, Any] | None = None) -> ReferenceFile:
    """The file of a live reference run: ``predictions`` of ``requests`` (aligned) by the release at
    ``reference_dir``, computed in ``dtype`` at ``context`` tokens."""
    from clef_local.formats.manifest import release_digest, sha256
    from clef_local.formats.release import HEAD_CONFIG, HEAD_WEIGHTS

    if len(predictions) != len(requests):
        raise ValueError(f"{len(predictions)} predictions for {len(requests)} requests")
    directory = Path(reference_dir)
    records = [{"tokens_sha256": tokens_digest(p.encoded.input_ids),
                "questions": [{"id": q.question_id, "options": list(q.option_ids),
                               "p": [float(x) for x in np.asarray(probs, dtype=np.float32)[: len(q.option_ids)]]}
                              for q, probs in zip(p.encoded.questions, p.probabilities, strict=True)]}
               for p in predictions]
    identity = {"path": str(reference_dir), "digest": release_digest(directory),
                "head": {name: sha256(directory / name) for name in (HEAD_WEIGHTS, HEAD_CONFIG)}}
    import clef_local

    info = {"created": datetime.now(UTC).isoformat(timespec="seconds"), "tool": f"clef-local {clef_local.__version__}",
            **(meta or {})}
    return ReferenceFile(identity, dtype, int(context), requests_digest(requests), truncate_state, records, info)


def write(ref: ReferenceFile, path: str | Path) -> Path:
    """Write ``ref`` to ``path`` with its content digest."""
    content = ref.content()
    data = {**content, "content_sha256": hashlib.sha256(canonical(content)).hexdigest()}
    path = Path(path)
    path.write_text(json.dumps(data, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def read(path: str | Path) -> ReferenceFile:
    """The reference file at ``path``; :class:`ReferenceFileError` when it is not one, or its content does not
    match its digest."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReferenceFileError(f"{path}: no such reference file; make one with {MAKE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReferenceFileError(f"{path}: not a reference file ({exc}); make one with {MAKE}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ReferenceFileError(f"{path}: not a reference file (format {found!r}, expected {FORMAT}); make one "
                                 f"with {MAKE}")
    digest = data.pop("content_sha256", None)
    if digest != hashlib.sha256(canonical(data)).hexdigest():
        raise ReferenceFileError(f"{path}: its content does not match its content_sha256 (edited or damaged); "
                                 f"make it again with {MAKE}")
    try:
        return ReferenceFile(reference=dict(data["reference"]), dtype=str(data["dtype"]), context=int(data["context"]),
                             requests_sha256=str(data["requests"]["sha256"]),
                             truncate_state=bool(data["truncate_state"]), records=list(data["records"]),
                             meta=dict(data.get("meta") or {}), path=path)
    except (KeyError, TypeError, ValueError) as exc:
        raise ReferenceFileError(f"{path}: a {FORMAT} file without {exc}; make it again with {MAKE}") from None


def check_requests(ref: ReferenceFile, requests: Sequence[Mapping[str, Any]], source: str) -> None:
    """Refuse unless ``requests`` (named ``source``) are the ones the file was computed on."""
    digest = requests_digest(requests)
    if digest != ref.requests_sha256 or len(requests) != len(ref.records):
        raise ReferenceFileError(
            f"{ref.name} holds probabilities for other requests ({len(ref.records)} requests, sha256 "
            f"{ref.requests_sha256[:12]}) than {source} ({len(requests)} requests, sha256 {digest[:12]}); pass the "
            f"same --data/--limit it was made with, or make it again on these requests")


def check_reference(ref: ReferenceFile, reference_dir: str | Path) -> None:
    """Refuse unless the file was computed by the release at ``reference_dir``."""
    from clef_local.formats.manifest import release_digest

    digest = release_digest(reference_dir)
    if digest != ref.reference["digest"]:
        raise ReferenceFileError(
            f"{ref.name} was computed by another reference: {ref.reference['path']} (digest "
            f"{ref.reference['digest'][:12]}), not {reference_dir} (digest {digest[:12]}); make it again with "
            f"clef-local drift --reference {reference_dir} --save-reference FILE")


def check_run(ref: ReferenceFile, *, dtype: str, context: int | None) -> None:
    """Refuse a comparison run in another compute dtype or at another context than the file's."""
    if dtype != ref.dtype:
        raise ReferenceFileError(f"{ref.name} was computed in {ref.dtype}, this run is in {dtype}: pass --dtype "
                                 f"{ref.dtype} (or leave --dtype auto, which follows the file)")
    if context is not None and context != ref.context:
        raise ReferenceFileError(f"{ref.name} was computed at a context of {ref.context:,} tokens, this model's is "
                                 f"{context:,}: compare models with the same context")


def check_candidate(ref: ReferenceFile, candidate: str | Path) -> str | None:
    """Refuse a variant exported from another release than the file's reference (its manifest's ``source``);
    return a warning when the candidate's head files differ from the reference's (as
    :func:`clef_local.quality.drift.head_difference` warns), else None."""
    from clef_local.formats.manifest import sha256, source_digest

    source = source_digest(candidate)
    if source is not None and source != ref.reference["digest"]:
        raise ReferenceFileError(
            f"{candidate} was exported from another release (source digest {source[:12]}) than {ref.name}'s "
            f"reference {ref.reference['path']} (digest {ref.reference['digest'][:12]}); compare it with its own "
            f"source's reference file")
    differ = [name for name, digest in ref.reference.get("head", {}).items()
              if sha256(Path(candidate) / name) != digest]
    if not differ:
        return None
    return (f"{candidate}: {' and '.join(differ)} differ from {ref.reference['path']}'s (as {ref.name} records them) "
            f"— this compares two different heads, not a quantization; re-export the variant from this reference")


def predictions_for(ref: ReferenceFile, candidate: Sequence[Prediction]) -> list[Prediction]:
    """The file's probabilities as :class:`~clef_local.model.Prediction` objects aligned with ``candidate``'s (the
    candidate's encoded records, the reference's numbers); refused when a request was encoded into other tokens,
    questions or options than the reference's."""
    from clef_local.model import Prediction

    if len(candidate) != len(ref.records):
        raise ReferenceFileError(f"{ref.name} holds {len(ref.records)} requests, this run {len(candidate)}")
    out = []
    for n, (pred, record) in enumerate(zip(candidate, ref.records, strict=True)):
        if tokens_digest(pred.encoded.input_ids) != record["tokens_sha256"]:
            raise ReferenceFileError(f"request {n} encodes into other tokens than when {ref.name} was made (another "
                                     "tokenizer, template or context); compare models that share the reference's")
        questions = [(q.question_id, list(q.option_ids)) for q in pred.encoded.questions]
        stored = [(q["id"], list(q["options"])) for q in record["questions"]]
        if questions != stored:
            raise ReferenceFileError(f"request {n}'s questions or options differ from {ref.name}'s ({stored} vs "
                                     f"{questions})")
        out.append(Prediction(pred.encoded, [np.asarray(q["p"], dtype=np.float32) for q in record["questions"]]))
    return out
