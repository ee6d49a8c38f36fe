"""Atomic export directories, shared by ``quantize`` and ``export-onnx``.

Everything is written into a hidden sibling ``.{out}.tmp-{pid}-{random}`` that is renamed to ``out`` only when
complete; any exception removes it; a temp left by a killed run is removed by the next run (unless its process is
still alive). An existing ``out`` is refused without ``force``; with it the old directory is moved aside only after
the new one is complete. The source is never written.
"""

from __future__ import annotations

import glob
import logging
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from clef_local.errors import ClefError

log = logging.getLogger(__name__)


class ExportError(ClefError, ValueError):
    """An export refused or failed for a reason the user can fix (paths, scheme, group size, source)."""


def resolve_out(out: str | Path) -> Path:
    """``out`` made absolute with its parent resolved (``out`` itself may be a link to refuse, so it is kept)."""
    out = Path(out).expanduser().absolute()
    return out.parent.resolve() / out.name


def _is_within(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def check_paths(source: Path, out: Path, force: bool) -> None:
    """Refuse an ``out`` that is (inside) the source, holds it, exists without ``force``, or is not a directory."""
    if _is_within(out, source):
        raise ExportError(f"--out {out} is the source release or inside it; write the variant elsewhere")
    if _is_within(source, out):
        raise ExportError(f"--out {out} contains the source release {source}; write the variant elsewhere")
    if out.exists() or out.is_symlink():
        if not force:
            raise ExportError(f"{out} exists; pass --force to replace it (the old one stays until the new one is "
                              f"complete)")
        if not out.is_dir() or out.is_symlink():
            raise ExportError(f"{out} exists and is not a directory; refusing to replace it")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    return True


def clean_stale(out: Path) -> list[Path]:
    """Remove ``.{out.name}.tmp-*`` / ``.trash-*`` siblings left by killed exports (not those of a live process)."""
    removed = []
    for kind in ("tmp", "trash"):
        for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.{kind}-*")):
            pid = path.name.removeprefix(f".{out.name}.{kind}-").split("-")[0]
            if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
                log.info("leaving %s: its export (pid %s) is still running", path, pid)
                continue
            log.info("removing stale %s left by an interrupted export", path)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _sibling(out: Path, kind: str) -> Path:
    """A fresh, empty hidden sibling of ``out`` (created with the umask's permissions, unlike mkdtemp's 0700)."""
    while True:
        path = out.parent / f".{out.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def _finalize(tmp: Path, out: Path) -> None:
    """Rename the complete ``tmp`` to ``out``; an existing ``out`` is moved aside first and deleted after."""
    if not out.exists():
        os.replace(tmp, out)
        return
    trash = _sibling(out, "trash")
    trash.rmdir()
    os.replace(out, trash)
    os.replace(tmp, out)
    shutil.rmtree(trash, ignore_errors=True)
    log.info("replaced the previous %s (--force)", out)


@contextmanager
def staged(source: Path, out: Path, force: bool) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out``; on a clean exit it becomes ``out``, on any exception it goes.

    Paths are checked first (:func:`check_paths`) and stale temporaries of killed runs removed.
    """
    check_paths(source, out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    tmp = _sibling(out, "tmp")
    try:
        yield tmp
        _finalize(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
