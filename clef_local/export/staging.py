"""Atomic export directories, shared by ``quantize`` and ``export-onnx``: written into a hidden temporary sibling,
renamed into place only when complete; ``force`` moves the old directory aside only after, and a run killed between
the two renames is undone by the next (:func:`restore_interrupted`). The rules, failure by failure:
docs/format.md §6 ("Atomic export"). The source is never written.
"""

from __future__ import annotations

import errno
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
    """An export refused or failed for a reason the user can fix (paths, scheme, group size, source, disk)."""


def resolve_out(out: str | Path) -> Path:
    """``out`` made absolute with its parent resolved (``out`` itself may be a link to refuse, so it is kept)."""
    out = Path(out).expanduser().absolute()
    return out.parent.resolve() / out.name


def _is_within(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def check_parent(out: Path) -> None:
    """Refuse an ``out`` whose parent is missing (it is not created: a typo must not grow a directory tree), is not a
    directory, is a virtual filesystem (``/proc``, ``/sys``: no blocks), is mounted read-only or is not writable."""
    parent = out.parent
    existing = next(p for p in (parent, *parent.parents) if p.exists())
    if not existing.is_dir():
        raise ExportError(f"--out {out}: {existing} is a file, not a directory; choose an --out inside a directory")
    if existing != parent:
        missing = next(p for p in (parent, *parent.parents) if p.parent == existing)
        raise ExportError(f"--out {out}: the directory {parent} does not exist ({missing} is missing); create it "
                          f"first or choose another --out")
    try:
        stat = os.statvfs(parent)
    except OSError as exc:
        raise ExportError(f"--out {out}: cannot inspect {parent} ({exc.strerror}); choose another --out") from exc
    if stat.f_blocks == 0:
        raise ExportError(f"--out {out}: {parent} is a virtual filesystem with no storage (like /proc or /sys); "
                          f"choose an --out on a disk")
    if stat.f_flag & os.ST_RDONLY:
        raise ExportError(f"--out {out}: {parent} is on a read-only filesystem; choose an --out on a writable disk")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"--out {out}: {parent} is not writable for this user; choose an --out you can write, or "
                          f"change its permissions")


def check_paths(source: Path, out: Path, force: bool) -> None:
    """Refuse an ``out`` that is (inside) the source, holds it, lies in a missing, read-only or virtual directory
    (:func:`check_parent`), exists without ``force``, or is not a directory.

    What killed runs left is dealt with first (:func:`recover`): a variant moved aside by a killed ``--force`` run is
    put back, so it counts as existing."""
    if _is_within(out, source):
        raise ExportError(f"--out {out} is the source release or inside it; write the variant elsewhere")
    if _is_within(source, out):
        raise ExportError(f"--out {out} contains the source release {source}; write the variant elsewhere")
    check_parent(out)
    try:
        recover(out)
    except OSError as exc:
        raise io_error(exc, source, out) from exc
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


def _stale(out: Path, kind: str) -> list[Path]:
    """``.{out.name}.{kind}-*`` siblings whose export is not running (killed, or this process's own)."""
    found = []
    for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.{kind}-*")):
        pid = path.name.removeprefix(f".{out.name}.{kind}-").split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
            log.info("leaving %s: its export (pid %s) is still running", path, pid)
            continue
        found.append(path)
    return found


def restore_interrupted(out: Path) -> Path | None:
    """When ``out`` is missing and a killed ``--force`` run left its previous contents in a trash sibling, rename
    that trash back to ``out`` (the previous complete variant; never deleted). Returns the restored trash."""
    if out.exists() or out.is_symlink():
        return None
    trashes = sorted(_stale(out, "trash"), key=lambda p: p.stat().st_mtime)
    if not trashes:
        return None
    trash = trashes[-1]  # one at most in practice: each run restores before it moves anything aside
    os.replace(trash, out)
    log.warning("restored %s from %s: an export with --force was killed while replacing it", out, trash.name)
    return trash


def recover(out: Path) -> list[Path]:
    """Undo what killed exports to ``out`` left: :func:`restore_interrupted`, then :func:`clean_stale`."""
    restore_interrupted(out)
    return clean_stale(out)


def clean_stale(out: Path) -> list[Path]:
    """Remove the temporaries of killed exports (not those of a live process): every ``.{out.name}.tmp-*``, and a
    ``.trash-*`` only when ``out`` is a complete variant (its manifest checks: the trash was being deleted after a
    finished replacement); any other trash is kept and named."""
    from clef_local.formats.manifest import check_files, read_manifest

    removed = []
    for path in _stale(out, "tmp"):
        log.info("removing stale %s left by an interrupted export", path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    trashes = _stale(out, "trash")
    if trashes:
        complete = out.is_dir() and read_manifest(out) is not None and not check_files(out)
        for path in trashes:
            if not complete:
                log.warning("keeping %s (the previous contents of %s, moved aside by an interrupted --force "
                            "export): %s is not a complete variant; delete it by hand once you do not need it",
                            path, out, out)
                continue
            log.info("removing stale %s: %s is complete", path, out)
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
    """Rename the complete ``tmp`` to ``out``; an existing ``out`` is moved aside first and deleted after (put back
    if the second rename fails)."""
    if not out.exists():
        os.replace(tmp, out)
        return
    trash = _sibling(out, "trash")
    trash.rmdir()
    os.replace(out, trash)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(trash, out)
        raise
    shutil.rmtree(trash, ignore_errors=True)
    log.info("replaced the previous %s (--force)", out)


HINTS = {
    errno.ENOSPC: "the disk is full: free space or choose an --out on another disk",
    errno.EDQUOT: "the disk quota is used up: free space or choose an --out on another disk",
    errno.EROFS: "the filesystem is read-only: choose an --out on a writable disk",
    errno.EACCES: "permission denied: choose an --out you can write",
    errno.EPERM: "not permitted: choose an --out you can write",
}


def io_error(exc: OSError, source: Path, out: Path) -> ExportError:
    """An :class:`ExportError` for an ``OSError`` met during an export: the path, the reason, what to do."""
    where = Path(exc.filename) if exc.filename else out.parent
    if _is_within(where.absolute(), source):
        return ExportError(f"cannot read {where} ({exc.strerror or exc}); nothing was written to {out}")
    hint = HINTS.get(exc.errno or 0, f"check the disk holding {out.parent}")
    return ExportError(f"cannot write {where} ({exc.strerror or exc}): {hint}; nothing was written to {out}")


@contextmanager
def staged(source: Path, out: Path, force: bool) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out``; on a clean exit it becomes ``out``, on any exception it goes.

    Paths are checked first (:func:`check_paths`: an interrupted replacement restored, stale temporaries of killed
    runs removed). An ``OSError`` (full disk, read-only mount, permissions) becomes an :class:`ExportError`.
    """
    check_paths(source, out, force)
    try:
        tmp = _sibling(out, "tmp")
    except OSError as exc:
        raise io_error(exc, source, out) from exc
    try:
        yield tmp
        _finalize(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and not isinstance(exc, ClefError):
            raise io_error(exc, source, out) from exc
        raise
