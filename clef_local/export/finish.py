"""The end of every weight export (``quantize``, one scheme or ``--format mixed``): once the shards, their index and
``config.json`` are in the staging directory, copy the release's other files byte for byte, validate (or record
``--no-validate``), measure the bytes, write the manifest and check it. :func:`clef_local.export.staging.staged`
then renames the directory into place. docs/format.md §6.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_local.export.shards import INDEX
from clef_local.export.staging import ExportError
from clef_local.export.validate import VALIDATION
from clef_local.formats.manifest import MANIFEST, check_files, file_entries, list_files, write_manifest
from clef_local.formats.release import CONFIG

SKIPPED = {"validated": False, "skipped": "--no-validate"}


@dataclass(frozen=True)
class Finished:
    """What the tail measured: the validation record, the bytes before and after, the bits per quantized weight."""

    validation: dict[str, Any]
    nbytes: dict[str, int]
    bits: float


def copy_other_files(source: Path, tmp: Path, written: Collection[str]) -> None:
    """Copy every file of ``source`` the export did not write (tokenizer, head, processors…) into ``tmp``."""
    skip = {*written, INDEX, CONFIG, MANIFEST, VALIDATION}
    for name in list_files(source):
        if name not in skip:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, tmp / name)


def finish_variant(source: Path, tmp: Path, *, shards: Collection[str], result: dict[str, Any],
                   source_files: dict[str, Any], scheme: str, group_size: int | None, fallback_bits: float,
                   validate: Callable[[Path], dict[str, Any]] | None) -> Finished:
    """Complete the variant staged in ``tmp`` (module docstring). ``result``: :func:`quantize_shards`' record;
    ``source_files``: the source's manifest entries; ``validate(tmp)`` validates and writes ``validation.json``
    (None: ``--no-validate``, recorded so); ``fallback_bits``: the bits per weight when nothing was quantized.
    :class:`ExportError` when the written variant does not check against its own manifest."""
    import clef_local

    copy_other_files(source, tmp, shards)
    if validate is not None:
        validation = validate(tmp)
    else:
        validation = dict(SKIPPED)
        (tmp / VALIDATION).write_text(json.dumps(validation, indent=2) + "\n", encoding="utf-8")
    # the shards were hashed as they were written (quantize_shards' "files"); the other files are hashed now
    names, written = list_files(tmp), result["files"]
    hashed = {**file_entries(tmp, [name for name in names if name not in written]), **written}
    files = {name: hashed[name] for name in names}  # in list_files' order, as file_entries(tmp) gave them
    sizes = result["sizes"]
    nbytes = {"linear_before": sizes.get("linear_before", 0), "linear_after": sizes.get("linear_after", 0),
              "total_before": sum(e["size"] for e in source_files.values()),
              "total_after": sum(e["size"] for e in files.values())}
    bits = 8 * nbytes["linear_after"] / result["params"] if result["params"] else fallback_bits
    write_manifest(tmp, tool="clef-local", version=clef_local.__version__,
                   scheme={"name": scheme, "group_size": group_size, "bits_per_weight": round(bits, 4)},
                   source={"path": str(source), "files": source_files}, files=files,
                   quantized=result["quantized"], skipped=result["skipped"], bytes=nbytes)
    if problems := check_files(tmp):
        raise ExportError("the written variant does not check: " + "; ".join(problems))
    return Finished(validation, nbytes, bits)
