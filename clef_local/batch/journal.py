"""Committed chunks and their journal: what makes a batch job resumable and exact-once.

A decided chunk's files are renamed into ``OUT.parts/`` whole, then one appended ``journal.jsonl`` line commits it;
a rerun of the same job (checked against the journal's first line) keeps the committed chunks whose hashes match
and decides the rest, so the output is the same bytes however often it was interrupted (docs/batch.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_local.errors import BatchError

log = logging.getLogger(__name__)

JOURNAL = "journal.jsonl"
VERSION = 1


def file_sha256(path: Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while data := f.read(block):
            digest.update(data)
    return digest.hexdigest()


def model_fingerprint(path: Path) -> str:
    """A SHA-256 that changes when the model's answers can: its configs, tokenizer, head, and each backbone weight
    file's name, size and safetensors header (hashing gigabytes of weights on every start would cost minutes)."""
    from clef_local.formats.release import CONFIG, HEAD_CONFIG, HEAD_WEIGHTS, find_weight_files

    digest = hashlib.sha256()
    for name in (CONFIG, HEAD_CONFIG, HEAD_WEIGHTS, "tokenizer.json", "tokenizer_config.json"):
        file = path / name
        if file.is_file():
            digest.update(f"{name}\0{file_sha256(file)}\0".encode())
    for file in find_weight_files(path):
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = f.read(min(size, 1 << 26))
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode() + header)
    return digest.hexdigest()


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Write to the yielded temporary path; on success it is flushed and renamed onto ``path`` (all or nothing)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_directory(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _write_bytes(path: Path, data: bytes) -> str:
    with replacing(path) as tmp:
        tmp.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Committed:
    """One committed chunk as its journal line records it."""

    chunk: int
    rows: int
    errors: int
    out_sha256: str
    err_sha256: str


def describe(value: Any) -> str:
    """A job entry as the mismatch message shows it."""
    if isinstance(value, Mapping) and "shown" in value:
        return str(value["shown"])
    return json.dumps(value, ensure_ascii=False)


def _same(old: Any, new: Any) -> bool:
    # entries with a "value" compare by it (a model by fingerprint, not by where it lies); the rest as they are
    if isinstance(old, Mapping) and isinstance(new, Mapping) and "value" in old and "value" in new:
        return bool(old["value"] == new["value"])
    return bool(old == new)


class Journal:
    """The committed chunks of one job in ``directory`` (``OUT.parts``); see the module docstring."""

    def __init__(self, directory: Path, job: dict[str, Any], committed: dict[int, Committed]) -> None:
        self.directory = directory
        self.job = job
        self.committed = committed

    @classmethod
    def open(cls, directory: Path, job: dict[str, Any], *, force: bool = False) -> Journal:
        """Resume the journal in ``directory`` if it describes ``job``, or start a new one.

        ``job`` maps names to JSON values; an entry ``{"value": v, "shown": text}`` compares by ``v`` and shows
        ``text``. A journal for another job raises :class:`BatchError` unless ``force`` (which starts over).
        """
        journal = directory / JOURNAL
        if force and directory.exists():
            shutil.rmtree(directory)
        if journal.is_file():
            return cls._resume(directory, job)
        if directory.exists():  # chunks without a journal (killed before its first line): nothing was committed
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        header = {"journal": VERSION, "job": job}
        _write_bytes(journal, (json.dumps(header, ensure_ascii=False, sort_keys=True) + "\n").encode())
        return cls(directory, job, {})

    @classmethod
    def _resume(cls, directory: Path, job: dict[str, Any]) -> Journal:
        path = directory / JOURNAL
        lines = path.read_bytes().split(b"\n")
        try:
            header = json.loads(lines[0])
        except json.JSONDecodeError:
            raise BatchError(f"{path}: the journal's first line is not JSON; pass --force to start over") from None
        if header.get("journal") != VERSION:
            raise BatchError(f"{path}: journal version {header.get('journal')!r}, this clef-local writes "
                             f"{VERSION}; pass --force to start over")
        old = header.get("job", {})
        differences = [f"{key}: {describe(old.get(key))} in the journal, {describe(job.get(key))} now"
                       for key in sorted(set(old) | set(job)) if not _same(old.get(key), job.get(key))]
        if differences:
            raise BatchError(f"{directory} holds a job that was started differently ({'; '.join(differences)}); rerun "
                             "with the original arguments to resume it, or pass --force to start over")
        committed: dict[int, Committed] = {}
        for raw in lines[1:-1]:  # the last piece is empty (the file ends with a newline) or a torn line
            try:
                entry = Committed(**json.loads(raw))
            except (json.JSONDecodeError, TypeError):
                log.warning("%s: ignoring a journal line that is not a commit: %r", path, raw[:80])
                continue
            out, err = cls.paths(directory, entry.chunk)
            if out.is_file() and err.is_file() and file_sha256(out) == entry.out_sha256 \
                    and file_sha256(err) == entry.err_sha256:
                committed[entry.chunk] = entry
            else:
                log.warning("%s: chunk %d's files changed since they were committed; deciding it again", path,
                            entry.chunk)
        journal = cls(directory, job, committed)
        if lines[-1] != b"":  # drop the torn line so that the next commit starts on a line of its own
            with path.open("ab") as f:
                f.write(b"\n")
        return journal

    @staticmethod
    def paths(directory: Path, chunk: int) -> tuple[Path, Path]:
        return directory / f"{chunk:08d}.out.jsonl", directory / f"{chunk:08d}.err.jsonl"

    def commit(self, chunk: int, out: bytes, err: bytes, *, rows: int, errors: int) -> None:
        """Write one decided chunk's answers and errors, then its journal line (the commit point)."""
        if chunk in self.committed:  # a chunk delivered twice (a retried task) is written once
            log.debug("chunk %d is committed already; ignoring the second copy", chunk)
            return
        out_path, err_path = self.paths(self.directory, chunk)
        entry = Committed(chunk, rows, errors, _write_bytes(out_path, out), _write_bytes(err_path, err))
        line = json.dumps(entry.__dict__, sort_keys=True) + "\n"
        with (self.directory / JOURNAL).open("ab") as f:
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())
        self.committed[chunk] = entry

    def remove(self) -> None:
        """Delete the journal first (the job is no longer resumable), then the chunks."""
        (self.directory / JOURNAL).unlink(missing_ok=True)
        shutil.rmtree(self.directory)
