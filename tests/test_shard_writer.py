"""The export's background shard writer (``clef_local/export/shards.py``): the bytes and manifest of writing each shard
while the next is quantized are those of writing them in turn, and a write's or the main thread's error leaves no
thread running and nothing outside the staging directory."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from clef_local import quant
from clef_local.export import shards as shards_module
from clef_local.export.quantize import ExportError, quantize_release
from clef_local.export.shards import WRITER_THREAD, quantize_shards
from clef_local.formats.manifest import MANIFEST, read_manifest, release_digest, verify
from clef_local.formats.release import read_release
from clef_local.testing import build_tiny_release


def hashes(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(WRITER_THREAD)]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_release(tmp_path_factory.mktemp("src") / "qwen3_5", "qwen3_5", seed=7, shards=3)


def shard_names(source: Path) -> list[str]:
    return [f.name for f in read_release(source).weight_files]


@pytest.mark.parametrize("layout", [None, "compressed"])
def test_background_writes_give_the_sequential_bytes(source: Path, tmp_path: Path, monkeypatch,
                                                     layout: str | None) -> None:
    """int4 on the mse grid, in the MLX and the compressed layout: every file and the manifest's digests equal."""
    assert len(shard_names(source)) == 3
    monkeypatch.setattr(shards_module, "BACKGROUND_WRITES", False)
    quantize_release(source, tmp_path / "sequential", "int4", validate=False, int4_layout=layout, log_summary=False)
    monkeypatch.setattr(shards_module, "BACKGROUND_WRITES", True)
    quantize_release(source, tmp_path / "overlapped", "int4", validate=False, int4_layout=layout, log_summary=False)
    sequential, overlapped = tmp_path / "sequential", tmp_path / "overlapped"
    assert hashes(overlapped) == hashes(sequential)
    assert release_digest(overlapped) == release_digest(sequential)
    manifest = read_manifest(overlapped)
    assert manifest is not None and set(shard_names(source)) <= set(manifest["files"])
    assert verify(overlapped) == []  # the shards' digests, taken as they were written, are those on disk
    mode = 0o666 & ~_umask()
    assert {(p.stat().st_mode & 0o777) for p in overlapped.glob("model*.safetensors")} == {mode}
    assert writer_threads() == []


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_failed_write_of_the_first_shard_is_raised_as_its_oserror(source: Path, tmp_path: Path,
                                                                    monkeypatch) -> None:
    """A full disk on shard 1 of 3, as save_shard reports it: the same OSError out of quantize_shards, nothing
    after it handed to the writer; through the export, the one-line ExportError and no staging directory left."""
    names = shard_names(source)
    raised: list[OSError] = []
    written: list[str] = []

    def save_shard(tensors: dict[str, Any], path: Path, metadata: dict[str, str] | None) -> None:
        if path.name == names[0]:
            raised.append(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)))
            raise raised[-1]
        written.append(path.name)

    monkeypatch.setattr(shards_module, "save_shard", save_shard)
    with pytest.raises(OSError) as info:
        quantize_shards(source, tmp_path, names, quant.get("int8"), None, {})
    assert info.value is raised[0] and written == []
    assert writer_threads() == []
    out = tmp_path / "out" / "v"
    out.parent.mkdir()
    with pytest.raises(ExportError) as export:
        quantize_release(source, out, "int8", validate=False, log_summary=False)
    assert export.value.__cause__ is raised[1]
    assert str(export.value).startswith(f"cannot write {out.parent}/.v.tmp-")
    assert str(export.value).endswith(f"/{names[0]} (No space left on device): the disk is full: free space or "
                                      f"choose an --out on another disk; nothing was written to {out}")
    assert list(out.parent.iterdir()) == [] and written == [] and writer_threads() == []


def test_an_error_while_quantizing_waits_for_the_write_in_flight(source: Path, tmp_path: Path, monkeypatch) -> None:
    """The main thread fails on shard 2 while shard 1 is still being written: the write finishes before the error
    leaves quantize_shards (so the caller's removal of the staging directory is final) and the thread is gone."""
    names = shard_names(source)
    started, finished = threading.Event(), threading.Event()
    real = shards_module.save_shard

    def save_shard(tensors: dict[str, Any], path: Path, metadata: dict[str, str] | None) -> None:
        started.set()
        assert threading.current_thread().name.startswith(WRITER_THREAD)
        threading.Event().wait(0.5)  # still writing when the main thread fails
        real(tensors, path, metadata)
        finished.set()

    second = set(shard_keys(source, names[1]))

    def on_tensor(name: str) -> None:
        if name in second:
            assert started.wait(10)
            raise RuntimeError(f"failed on {name}")

    monkeypatch.setattr(shards_module, "save_shard", save_shard)
    with pytest.raises(RuntimeError, match="failed on"):
        quantize_shards(source, tmp_path, names, quant.get("int8"), None, {}, on_tensor=on_tensor)
    assert finished.is_set() and writer_threads() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [names[0]]  # the one shard, whole, in staging only


def shard_keys(source: Path, shard: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(source / shard), framework="pt") as f:
        return list(f.keys())


def test_the_manifest_lists_the_shards_as_hashed_on_disk(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "v"
    quantize_release(source, out, "int8", validate=False, log_summary=False)
    manifest = read_manifest(out)
    assert manifest is not None
    for name in shard_names(source):
        entry = manifest["files"][name]
        assert entry == {"size": (out / name).stat().st_size,
                         "sha256": hashlib.sha256((out / name).read_bytes()).hexdigest()}
    assert list(manifest["files"]) == sorted(manifest["files"]) and MANIFEST not in manifest["files"]
