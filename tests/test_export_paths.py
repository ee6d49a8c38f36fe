"""Where a variant is written: a bad ``--out`` (missing parent, a file, /proc, read-only, full disk) is one line and
exit 2 with nothing written and the source untouched; a killed ``--force`` keeps the previous variant."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from clef_local.cli import main as cli_main
from clef_local.export import staging
from clef_local.export.quantize import quantize_release
from clef_local.export.staging import ExportError
from clef_local.formats.manifest import read_manifest, verify
from clef_local.testing import build_tiny_release


def hashes(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def siblings(out: Path) -> list[Path]:
    return sorted(p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_release(tmp_path_factory.mktemp("src") / "llama", "llama", seed=7)


@contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` (root only); the test is skipped where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def quantize_cli(source: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, list[str]]:
    code = cli_main(["quantize", "--model", str(source), "--format", "int8", "--out", str(out), "--no-validate",
                     *extra])
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()]


@pytest.mark.parametrize("case", ["missing-parent", "parent-is-a-file", "proc"])
def test_a_bad_out_parent_is_one_line_and_exit_2(source: Path, tmp_path: Path, capsys, case: str) -> None:
    before = hashes(source)
    if case == "missing-parent":
        out, message = tmp_path / "a" / "b" / "v", (f"--out {tmp_path / 'a' / 'b' / 'v'}: the directory "
                                                    f"{tmp_path / 'a' / 'b'} does not exist ({tmp_path / 'a'} is "
                                                    f"missing); create it first or choose another --out")
    elif case == "parent-is-a-file":
        (tmp_path / "file").write_text("not a directory")
        out, message = tmp_path / "file" / "v", (f"--out {tmp_path / 'file' / 'v'}: {tmp_path / 'file'} is a file, "
                                                 f"not a directory; choose an --out inside a directory")
    else:
        out, message = Path("/proc/x"), ("--out /proc/x: /proc is a virtual filesystem with no storage (like /proc "
                                         "or /sys); choose an --out on a disk")
    code, err = quantize_cli(source, out, capsys)
    assert code == 2 and err == [f"error: {message}"]
    if case == "missing-parent":
        assert not (tmp_path / "a").exists()  # never created silently
    assert (tmp_path / "file").read_text() == "not a directory" if case == "parent-is-a-file" else True
    assert hashes(source) == before


def test_a_read_only_out_is_one_line_and_exit_2(source: Path, tmp_path: Path, capsys) -> None:
    if os.geteuid() != 0:
        target = tmp_path / "ro"
        target.mkdir()
        target.chmod(0o555)
        expected = f"{target} is not writable for this user"
    else:
        context = tmpfs(tmp_path / "ro", "ro,size=1M")
        target = context.__enter__()
        expected = f"{target} is on a read-only filesystem; choose an --out on a writable disk"
    try:
        code, err = quantize_cli(source, target / "v", capsys)
        assert code == 2 and len(err) == 1 and err[0] == f"error: --out {target / 'v'}: {expected}", err
        assert list(target.iterdir()) == []
    finally:
        if os.geteuid() == 0:
            context.__exit__(None, None, None)


def test_a_full_disk_is_one_line_and_exit_2_with_nothing_left(source: Path, tmp_path: Path, capsys,
                                                              monkeypatch) -> None:
    """A 64 KiB tmpfs: refused before any work by the disk check; and when the disk fills all the same (an estimate
    short of the truth: here the check is skipped), the first shard does not fit (safetensors reports "os error
    28"): one line too. Before, a traceback."""
    before = hashes(source)
    with tmpfs(tmp_path / "small", "size=64k") as disk:
        code, err = quantize_cli(source, disk / "v", capsys)
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith(f"error: not enough disk space for {disk / 'v'}: the int8 variant needs about ")
        assert f"and {disk} has 64.0 KiB free" in err[0] and list(disk.iterdir()) == []
        monkeypatch.setattr("clef_local.export.quantize.check_disk", lambda *args, **kwargs: 0)
        code, err = quantize_cli(source, disk / "v", capsys)
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith(f"error: cannot write {disk}/.v.tmp-") and err[0].endswith(
            f"(No space left on device): the disk is full: free space or choose an --out on another disk; nothing "
            f"was written to {disk / 'v'}"), err
        assert list(disk.iterdir()) == []
    assert hashes(source) == before


@pytest.mark.parametrize("where", ["shard", "copy"])
def test_no_space_while_writing_is_an_export_error(source: Path, tmp_path: Path, monkeypatch, where: str) -> None:
    """The same without a mount: safetensors' own error (a shard) or an OSError (a copied file) on a full disk."""
    from safetensors import SafetensorError

    if where == "shard":
        def save_file(*args, **kwargs):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr("safetensors.torch.save_file", save_file)
    else:
        def copyfile(src, dst, *args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

        monkeypatch.setattr(shutil, "copyfile", copyfile)
    out = tmp_path / "v"
    with pytest.raises(ExportError, match=r"\(No space left on device\): the disk is full") as info:
        quantize_release(source, out, "int8", validate=False)
    name = "model.safetensors" if where == "shard" else ""
    assert f"cannot write {tmp_path}/.v.tmp-" in str(info.value) and name in str(info.value)
    assert list(tmp_path.iterdir()) == []


KILL_WHILE_REPLACING = r"""
import os, signal, sys
from pathlib import Path
from clef_local.export.quantize import quantize_release

real = os.replace

def replace(src, dst):
    real(src, dst)
    if ".trash-" in Path(dst).name:  # the old variant is aside, the new one not yet in place: the worst moment
        os.kill(os.getpid(), signal.SIGKILL)

os.replace = replace
quantize_release(Path(sys.argv[1]), Path(sys.argv[2]), "int4", force=True, validate=False)
"""


def test_a_force_export_killed_while_replacing_keeps_the_previous_variant(source: Path, tmp_path: Path,
                                                                           caplog) -> None:
    """Before, the next run deleted the .trash-* sibling: the only copy of the previous complete variant."""
    out = tmp_path / "v"
    quantize_release(source, out, "int8", validate=False)
    previous = hashes(out)
    killed = subprocess.run([sys.executable, "-c", KILL_WHILE_REPLACING, str(source), str(out)], capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists()
    trash = [p for p in siblings(out) if ".trash-" in p.name]
    assert len(trash) == 1 and hashes(trash[0]) == previous

    with caplog.at_level("WARNING"), pytest.raises(ExportError, match="exists; pass --force"):
        quantize_release(source, out, "fp8", validate=False)  # without --force: restored, then refused
    assert hashes(out) == previous and verify(out) == [] and siblings(out) == []  # the dead run's temp went too
    assert f"restored {out} from {trash[0].name}" in caplog.text

    quantize_release(source, out, "fp8", force=True, validate=False)
    assert read_manifest(out)["scheme"]["name"] == "fp8" and siblings(out) == []


def test_a_failed_rename_puts_the_previous_variant_back(source: Path, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "v"
    quantize_release(source, out, "int8", validate=False)
    previous = hashes(out)
    real = os.replace

    def replace(src, dst):
        if ".tmp-" in Path(src).name:
            raise KeyboardInterrupt  # interrupted between moving the old variant aside and renaming the new one
        real(src, dst)

    monkeypatch.setattr(staging.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        quantize_release(source, out, "fp8", force=True, validate=False)
    monkeypatch.undo()
    assert hashes(out) == previous and siblings(out) == []


def test_a_stale_trash_goes_only_when_out_is_complete(source: Path, tmp_path: Path, caplog) -> None:
    out = tmp_path / "v"
    quantize_release(source, out, "int8", validate=False)
    dead = 2**22 + 4321  # above pid_max's default: not running
    trash = tmp_path / f".v.trash-{dead}-cafe0001"
    trash.mkdir()
    (trash / "config.json").write_text("{}")
    staging.clean_stale(out)  # out checks against its manifest: the trash was a finished replacement's leftover
    assert not trash.exists()

    trash.mkdir()
    (trash / "config.json").write_text("{}")
    manifest = json.loads((out / "clef_local_manifest.json").read_text())
    (out / "model.safetensors").write_bytes(b"truncated")  # out no longer a complete variant
    with caplog.at_level("WARNING"):
        staging.clean_stale(out)
    assert trash.is_dir() and f"keeping {trash}" in caplog.text
    assert "model.safetensors" in manifest["files"]


def test_a_truncated_source_shard_is_one_line_before_anything_is_written(source: Path, tmp_path: Path,
                                                                         capsys) -> None:
    broken = shutil.copytree(source, tmp_path / "broken")
    shard = broken / "model.safetensors"
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    out = tmp_path / "out"
    out.mkdir()
    code, err = quantize_cli(broken, out / "v", capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {shard}: truncated"), err
    assert list(out.iterdir()) == []
