"""A release's tensors read straight from its safetensors files, by name, for the streamed backbone
(:mod:`clef_local.backends.streaming`): whole tensors, and rows of a matrix (the embedding rows of a batch's ids,
the ``lm_head`` rows of its options).

The files are read with ``pread`` into tensors allocated for them, not memory-mapped: a mapped page that was read
stays in the process's resident set until the map goes, so a pass over an 18.8 GB file through ``safe_open`` would
show 18.8 GB of RSS (reclaimable, but not what the memory cap means); a read lands in the page cache, which the
kernel gives back under pressure, and in the one tensor that holds it. Reads of distinct tensors are independent
(``pread`` takes the offset, so the prefetch thread and the main thread may read at the same time).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from io import FileIO
from pathlib import Path

import torch

from clef_local.backends.skeleton import torch_dtype
from clef_local.errors import ReleaseError
from clef_local.formats.safetensors import TensorInfo, read_header

MAX_READ = 1 << 30  # bytes per read call: Linux caps one read at ~2 GiB, and a short read is retried anyway


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies: its file, the absolute byte offset of its data, and its header entry."""

    file: Path
    offset: int
    info: TensorInfo

    @property
    def nbytes(self) -> int:
        return self.info.nbytes


class WeightReader:
    """The tensors of ``files`` by name (each header checked first, :func:`~clef_local.formats.safetensors.
    read_header`); counts the bytes it reads (:attr:`bytes_read`)."""

    def __init__(self, files: Sequence[Path]) -> None:
        self.tensors: dict[str, StoredTensor] = {}
        for file in files:
            header = read_header(file)
            for name, info in header.tensors.items():
                if name in self.tensors:
                    raise ReleaseError(f"{file}: tensor {name} is also in {self.tensors[name].file}; a release holds "
                                       "each tensor once")
                self.tensors[name] = StoredTensor(Path(file), header.data_start + info.begin, info)
        self.bytes_read = 0
        self._lock = threading.Lock()  # guards the counter and, without os.preadv, each file's position
        self._files: dict[Path, FileIO] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def nbytes(self, names: Iterable[str]) -> int:
        """Stored bytes of ``names``."""
        return sum(self.tensors[n].nbytes for n in names)

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor ``name`` as stored, a floating one cast to ``dtype`` when given (an integer or packed tensor is
        never cast)."""
        stored = self._entry(name)
        out = torch.empty(stored.info.shape, dtype=torch_dtype(stored.info.dtype))
        if stored.nbytes:
            self._read_into(stored.file, stored.offset, out.reshape(-1).view(torch.uint8))
        if dtype is not None and out.is_floating_point() and out.dtype != dtype:
            out = out.to(dtype)
        return out

    def rows(self, name: str, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``ids`` (any shape of integer ids) of the 2-D tensor ``name``: ``[*ids.shape, width]``, each distinct
        row read once (runs of consecutive ids in one read), cast like :meth:`read`."""
        stored = self._entry(name)
        if len(stored.info.shape) != 2:
            raise ReleaseError(f"{stored.file}: {name} is {list(stored.info.shape)}, not a matrix of rows")
        rows, width = stored.info.shape
        flat = ids.reshape(-1).to("cpu", torch.long)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows):
            raise ValueError(f"token ids {int(flat.min())}..{int(flat.max())} outside {name}'s {rows} rows")
        unique, inverse = torch.unique(flat, return_inverse=True)
        table = torch.empty((len(unique), width), dtype=torch_dtype(stored.info.dtype))
        row_bytes = stored.nbytes // rows if rows else 0
        flat_table = table.view(torch.uint8).reshape(len(unique), row_bytes)
        values = unique.tolist()
        start = 0
        while start < len(values):  # one read per run of consecutive ids
            end = start + 1
            while end < len(values) and values[end] == values[end - 1] + 1:
                end += 1
            self._read_into(stored.file, stored.offset + values[start] * row_bytes, flat_table[start:end].reshape(-1))
            start = end
        out = table[inverse].reshape(*ids.shape, width)
        if dtype is not None and out.dtype != dtype:
            out = out.to(dtype)
        return out

    def close(self) -> None:
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files.clear()

    def _entry(self, name: str) -> StoredTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ReleaseError(f"tensor {name} is in none of the weight files") from None

    def _read_into(self, file: Path, offset: int, target: torch.Tensor) -> None:
        """Fill the contiguous uint8 tensor ``target`` with the bytes of ``file`` from ``offset``."""
        view = memoryview(target.numpy()).cast("B")
        done = 0
        with self._lock:
            handle = self._files.get(file)
            if handle is None:
                handle = self._files[file] = FileIO(file, "rb")
        while done < len(view):
            chunk = view[done:done + MAX_READ]
            if hasattr(os, "preadv"):  # positioned: no shared file position, no lock
                got = os.preadv(handle.fileno(), [chunk], offset + done)
            else:
                with self._lock:
                    handle.seek(offset + done)
                    got = handle.readinto(chunk) or 0
            if got <= 0:
                raise ReleaseError(f"{file}: ends before byte {offset + done + len(chunk)} (truncated after its header "
                                   "was checked?)")
            done += got
        with self._lock:
            self.bytes_read += done

