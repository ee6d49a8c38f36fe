"""``clef_local_manifest.json``: every file of a release or variant with its size and SHA-256 (docs/format.md §6).

:func:`check_files` runs on every load (sizes and safetensors headers: a truncated or garbled file is named);
:func:`verify` (``clef-local verify``) adds every SHA-256. A variant's manifest also records the scheme, the source's
hashes, the tool and byte counts; the demo model's holds its name and ``files``, all these checks read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from clef_local.errors import ReleaseError
from clef_local.formats.safetensors import SafetensorsError, read_header

log = logging.getLogger(__name__)

MANIFEST = "clef_local_manifest.json"
FORMAT = 1


def sha256(path: Path, block: int = 1 << 20) -> str:
    """The hex SHA-256 of a file, read in blocks (never the whole file in memory)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            digest.update(chunk)
    return digest.hexdigest()


def list_files(directory: Path, exclude: Iterable[str] = (MANIFEST,)) -> list[str]:
    """Every regular file under ``directory`` as a sorted relative POSIX path, minus ``exclude`` and hidden paths
    (``.cache/huggingface/...`` download metadata, ``.gitattributes``: not part of a release)."""
    skip = set(exclude)
    names = (p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() and not p.is_symlink())
    return sorted(n for n in names if n not in skip and not any(part.startswith(".") for part in n.split("/")))


def file_entries(directory: Path, names: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "sha256"}}`` for ``names`` (default: every file but the manifest)."""
    names = list_files(directory) if names is None else names
    return {name: {"size": (directory / name).stat().st_size, "sha256": sha256(directory / name)} for name in names}


def write_manifest(directory: str | Path, **fields: Any) -> Path:
    """Write ``clef_local_manifest.json`` into ``directory``: ``fields`` plus ``format`` and, unless given,
    ``files`` (size and SHA-256 of every file there but the manifest). Returns the manifest's path."""
    directory = Path(directory)
    manifest: dict[str, Any] = {"format": FORMAT, **fields}
    if "files" not in manifest:
        manifest["files"] = file_entries(directory)
    path = directory / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def read_manifest(directory: str | Path) -> dict[str, Any] | None:
    """The manifest of ``directory``, or None when it has none; a malformed one is a :class:`ReleaseError`."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReleaseError(f"{path} is not valid JSON: {exc}") from exc
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, dict) and "size" in v for v in files.values()):
        raise ReleaseError(f"{path}: must hold an object with \"files\": {{name: {{\"size\", \"sha256\"}}}}")
    return manifest


def files_digest(files: dict[str, Any]) -> str:
    """SHA-256 of a file list ``{name: {"size", "sha256"}}`` as canonical JSON (those two fields only): a release's
    identity, the same whether read from its manifest's ``files`` or from a variant's ``source.files``."""
    listing = {name: {"size": entry.get("size"), "sha256": entry.get("sha256")} for name, entry in files.items()}
    text = json.dumps(listing, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def release_digest(directory: str | Path) -> str:
    """The identity of a release or variant: :func:`files_digest` of its manifest's ``files`` (without a manifest,
    of every file, hashed now: a minute per ~10 GB). A variant's manifest records its source's as ``source.files``
    (:func:`source_digest`)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        log.info("%s has no %s: hashing its files to identify it", directory, MANIFEST)
        return files_digest(file_entries(directory))
    return files_digest(manifest["files"])


def source_digest(directory: str | Path) -> str | None:
    """The identity (:func:`files_digest`) of the release a variant was exported from, from its manifest's
    ``source.files``; None when the directory records no source (a release, not a variant)."""
    manifest = read_manifest(directory)
    source = manifest.get("source") if manifest else None
    files = source.get("files") if isinstance(source, dict) else None
    return files_digest(files) if isinstance(files, dict) else None


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file (header length, JSON header, data section), or None.

    Reads only the 8-byte length and the JSON header (:func:`clef_local.formats.safetensors.read_header`): the
    data section must be exactly as long as the largest tensor end offset, and every tensor's byte span must match
    its dtype and shape.
    """
    try:
        read_header(path)
    except SafetensorsError as exc:
        return exc.reason
    return None


def _file_problems(directory: Path, manifest: dict[str, Any]) -> dict[str, str]:
    """``{name: problem}`` for every listed file failing the cheap checks (exists, size, safetensors header)."""
    problems: dict[str, str] = {}
    for name, entry in sorted(manifest["files"].items()):
        path = directory / name
        if not path.is_file():
            problems[name] = f"missing (listed in {MANIFEST})"
            continue
        size = path.stat().st_size
        found = []
        if size != entry["size"]:
            found.append(f"{size} bytes, {MANIFEST} records {entry['size']}")
        if name.endswith(".safetensors") and (problem := safetensors_problem(path)):
            found.append(problem)
        if found:
            problems[name] = "; ".join(found)
    return problems


def check_files(directory: str | Path, manifest: dict[str, Any] | None = None) -> list[str]:
    """Cheap checks of every file the manifest lists (exists, size, safetensors header); one line per bad file,
    naming it. No manifest: nothing to check (empty list)."""
    directory = Path(directory)
    manifest = read_manifest(directory) if manifest is None else manifest
    if manifest is None:
        return []
    return [f"{directory / name}: {problem}" for name, problem in _file_problems(directory, manifest).items()]


def verify(directory: str | Path) -> list[str]:
    """Full check: :func:`check_files` plus the SHA-256 of every listed file; one line per bad file.

    A directory without a manifest is one problem (nothing can be verified)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        return [f"{directory}: no {MANIFEST} (nothing to verify against)"]
    problems = _file_problems(directory, manifest)
    for name, entry in sorted(manifest["files"].items()):
        if name not in problems and "sha256" in entry and sha256(directory / name) != entry["sha256"]:
            problems[name] = f"SHA-256 differs from {MANIFEST}"
    return [f"{directory / name}: {problem}" for name, problem in sorted(problems.items())]


def main(argv: list[str] | None = None) -> int:
    """``clef-local verify DIR``: exit 0 and "ok: N files verified", or exit 1 naming every bad file."""
    parser = argparse.ArgumentParser(prog="clef-local verify",
                                     description="Check every file of a release or variant against its manifest "
                                                 "(size, safetensors header, SHA-256).")
    parser.add_argument("directory", type=Path, help="release or variant directory holding " + MANIFEST)
    args = parser.parse_args(argv)
    try:
        manifest = read_manifest(args.directory)
    except ReleaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if manifest is None:
        print(f"error: {args.directory} has no {MANIFEST}", file=sys.stderr)
        return 1
    problems = verify(args.directory)
    if problems:
        for line in problems:
            print(f"bad: {line}")
        print(f"{len(problems)} problem(s) in {args.directory}", file=sys.stderr)
        return 1
    print(f"ok: {len(manifest['files'])} files verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
