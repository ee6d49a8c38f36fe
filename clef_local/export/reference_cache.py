"""The reference's answers on the validation probe set, kept in the user cache per release, so ``quantize`` runs the
reference once per release: the next variant of the same release (another scheme, group, grid) reuses them, and a
sequential validation that needs more probes than the last one adds only the missing ones.

One file per (release, probe set, compute dtype, context), in the reference-file format
(:mod:`clef_local.quality.reference_file`, content digest included) under ``<user cache>/references/``. The file
holds a *prefix* of the probe set: validation reads probes in order and stops when its verdict is decided. Before
use it is checked as ``--reference-file`` is: the release's manifest digest, the requests' hash (of the prefix it
covers), the dtype and context, and, per request, the token ids and questions the variant's run encodes. A cache
file that fails a check is named in a warning and recomputed, never used; one that cannot be written is logged and
the run goes on (it is a cache).
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
        """The cache entry for these keys, with the records of a valid cached file (none when there is none, or
        when it fails a check: logged with the file's name)."""
        probe_set = files.requests_digest(requests)[:16]
        name = f"{release_digest[:16]}-{probe_set}-{dtype}-{context}{'' if truncate_state else '-full'}.json"
        entry = cls(cache_folder(cache) / name, release_dir, release_digest, requests, dtype, int(context),
                    truncate_state)
        if not entry.path.is_file():
            return entry
        try:
            stored = files.read(entry.path)
            n = len(stored.records)
            if stored.reference.get("digest") != release_digest:
                raise files.ReferenceFileError(f"{entry.path}: computed by another release")
            if files.check_candidate(stored, release_dir) is not None:  # the head changed under the same manifest
                raise files.ReferenceFileError(f"{entry.path}: computed with another head than {release_dir}'s")
            files.check_requests(stored, requests[:n], f"the first {n} probes")
            files.check_run(stored, dtype=dtype, context=context)
            if stored.truncate_state != truncate_state:
                raise files.ReferenceFileError(f"{entry.path}: another truncate_state")
        except files.ReferenceFileError as exc:
            log.warning("ignoring the cached reference answers (%s); computing them again", exc)
            return entry
        entry.records, entry.meta = list(stored.records), dict(stored.meta)
        log.info("reference answers for %d of %d probes from the user cache (%s)", n, len(requests), entry.path)
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
        self.records.extend(new.records)
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
