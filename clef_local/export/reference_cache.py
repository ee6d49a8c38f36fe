"""The reference's answers on the validation probe set, kept in the user cache per release, so ``quantize`` runs the
reference once per release: the next variant of the same release (another scheme, group, grid) reuses them, and a
sequential validation that needs more probes than the last one adds only the missing ones.

One file per (release, compute dtype, context, first probe), in the reference-file format
(:mod:`clef_local.quality.reference_file`, content digest included) under ``<user cache>/references/``. The file
holds a *prefix* of a probe set: validation reads probes in order and stops when its verdict is decided, and the
probe sets of two schemes (256 probes for int4, 1024 for int8) are prefixes of one another, so they share it. Before
use it is checked as ``--reference-file`` is: the release's manifest digest and head files, the dtype and context,
each record's request digest against the probe it would answer, and, when used, each request's token ids and
questions against the variant's run. A cache file that fails a check is named in a warning and recomputed, never
used; one that cannot be written is logged and the run goes on (it is a cache).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_local.quality import reference_file as files

if TYPE_CHECKING:
    from clef_local.model import Prediction

log = logging.getLogger(__name__)

FOLDER = "references"
ENV = "CLEF_LOCAL_REFERENCES"  # another folder for them (a larger disk; the tests' own per test)


def cache_folder(cache: Path | None = None) -> Path:
    """``references/`` in ``cache``; None: ``$CLEF_LOCAL_REFERENCES``, else the user cache's
    (:func:`clef_local.demo.default.cache_dir`)."""
    if cache is None:
        if env := os.environ.get(ENV):
            return Path(env).expanduser()
        from clef_local.demo.default import cache_dir

        cache = cache_dir()
    return cache / FOLDER


@dataclass
class ReferenceCache:
    """The cached answers of one release on one probe set, in one dtype and context: ``records[i]`` answers
    ``requests[i]`` (a prefix of the probe set); :meth:`add` appends and writes through."""

    path: Path
    release_dir: Path
    release_digest: str
    requests: Sequence[Mapping[str, Any]]
    dtype: str
    context: int
    truncate_state: bool = True
    records: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def open(cls, release_dir: Path, release_digest: str, requests: Sequence[Mapping[str, Any]], *, dtype: str,
             context: int, truncate_state: bool = True, cache: Path | None = None) -> ReferenceCache:
        """The cache entry for these keys, with the records of a valid cached file that answer a prefix of
        ``requests`` (none when there is none, or when it fails a check: logged with the file's name). The file is
        found by the first request, so probe sets that are prefixes of one another (a scheme that may use 256
        probes, another 1024) share it; each record names its request's digest, checked here."""
        first = files.requests_digest(requests[:1])[:16]
        name = f"{release_digest[:16]}-{dtype}-{context}{'' if truncate_state else '-full'}-{first}.json"
        entry = cls(cache_folder(cache) / name, release_dir, release_digest, requests, dtype, int(context),
                    truncate_state)
        if not entry.path.is_file():
            return entry
        try:
            stored = files.read(entry.path)
            if stored.reference.get("digest") != release_digest:
                raise files.ReferenceFileError(f"{entry.path}: computed by another release")
            if files.check_candidate(stored, release_dir) is not None:  # the head changed under the same manifest
                raise files.ReferenceFileError(f"{entry.path}: computed with another head than {release_dir}'s")
            files.check_run(stored, dtype=dtype, context=context)
            if stored.truncate_state != truncate_state:
                raise files.ReferenceFileError(f"{entry.path}: another truncate_state")
        except files.ReferenceFileError as exc:
            log.warning("ignoring the cached reference answers (%s); computing them again", exc)
            return entry
        records = []
        for record, request in zip(stored.records, requests, strict=False):
            if record.get("request_sha256") != _digest(request):
                break  # another probe set from here on: the prefix before it is still this one's
            records.append(record)
        entry.records, entry.meta = records, dict(stored.meta)
        log.info("reference answers for %d of %d probes from the user cache (%s)", len(records), len(requests),
                 entry.path)
        return entry

    def covered(self) -> int:
        """How many probes (from the first) the cache answers."""
        return len(self.records)

    def answers(self, start: int, variant: Sequence[Prediction]) -> list[Prediction]:
        """The cached answers of probes ``start .. start + len(variant)``, aligned with the variant's predictions of
        them (refused, as a reference file is, when a probe encodes into other tokens or questions)."""
        stop = start + len(variant)
        if stop > len(self.records):
            raise ValueError(f"the cache answers {len(self.records)} probes, not {start}..{stop}")
        return files.predictions_for(self._file(self.records[start:stop], self.requests[start:stop]), variant)

    def add(self, start: int, predictions: Sequence[Prediction], meta: Mapping[str, Any]) -> None:
        """Record the live reference's ``predictions`` of probes ``start ..`` and write the file (atomically)."""
        if start != len(self.records):
            raise ValueError(f"the cache holds {len(self.records)} probes; adding at {start} would leave a gap")
        new = files.from_predictions(predictions, self.requests[start:start + len(predictions)],
                                     reference_dir=self.release_dir, dtype=self.dtype, context=self.context,
                                     truncate_state=self.truncate_state, meta=meta)
        self.records.extend({**record, "request_sha256": _digest(request)} for record, request in
                            zip(new.records, self.requests[start:start + len(predictions)], strict=True))
        self.meta = {**new.meta, "probe_set_sha256": files.requests_digest(self.requests)}
        whole = replace(new, records=self.records, meta=self.meta,
                        requests_sha256=files.requests_digest(self.requests[:len(self.records)]))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            files.write(whole, tmp)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot keep the reference answers in %s (%s); the next variant will run the reference "
                        "again", self.path, exc)

    def _file(self, records: list[dict[str, Any]], requests: Sequence[Mapping[str, Any]]) -> files.ReferenceFile:
        identity = {"path": str(self.release_dir), "digest": self.release_digest}
        return files.ReferenceFile(identity, self.dtype, self.context, files.requests_digest(requests),
                                   self.truncate_state, records, self.meta, self.path)


def _digest(request: Mapping[str, Any]) -> str:
    return files.requests_digest([request])
