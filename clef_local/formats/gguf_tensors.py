"""A GGUF file's tensor table and rows, read with gguf-py (pure Python, a memory map): what the planner counts
(bytes per role, the tensor types the file really holds) and the output-embedding rows the joint schema head reads.

The table is read once per file (:func:`gguf_table` caches it by path, size and modification time): gguf-py parses
the whole metadata section, the vocabulary and merges included (seconds at a 150K+ vocabulary). Only the rows asked
for are read from the tensor's bytes and dequantized (:meth:`GgufTable.rows`). The file must have passed
:func:`clef_local.formats.gguf_release.check_gguf`.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clef_local.errors import ReleaseError

if TYPE_CHECKING:
    from clef_local.formats.release import Release

OUTPUT = "output.weight"  # llama.cpp's lm_head
TOKEN_EMBD = "token_embd.weight"  # the input embedding, the lm_head too when tied (no output.weight)
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the table: its GGML type name (``Q4_K``, ``F32``, ...), numpy-order shape and stored bytes."""

    name: str
    type: str
    shape: tuple[int, ...]
    bytes: int


class GgufTable:
    """A GGUF's metadata that matters here and its tensor table (gguf-py's reader kept for :meth:`rows`)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = path
        self._reader = GGUFReader(path)
        self.tensors = {t.name: GgufTensor(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                                           int(t.n_bytes)) for t in self._reader.tensors}
        self._by_name = {t.name: t for t in self._reader.tensors}
        self.architecture = str(self.field("general.architecture"))

    def field(self, key: str) -> Any:
        """A metadata value (None when absent)."""
        found = self._reader.get_field(key)
        return None if found is None else found.contents()

    @property
    def file_type(self) -> str | None:
        """``general.file_type`` by name (``MOSTLY_Q4_K_M``, ``ALL_F32``, ...), or None."""
        from gguf import LlamaFileType

        value = self.field("general.file_type")
        try:
            return None if value is None else LlamaFileType(int(value)).name
        except ValueError:
            return str(value)

    @property
    def type_counts(self) -> dict[str, int]:
        """How many tensors of each GGML type the file holds."""
        return dict(sorted(Counter(t.type for t in self.tensors.values()).items()))

    @property
    def lexical_tensor(self) -> str:
        """The tensor whose rows are the head's lexical rows: ``output.weight``, else the tied ``token_embd``."""
        for name in (OUTPUT, TOKEN_EMBD):
            if name in self.tensors:
                return name
        raise ReleaseError(f"{self.path}: has neither {OUTPUT} nor {TOKEN_EMBD}; it is not a text backbone")

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of tensor ``name`` as float32 ``[len(ids), columns]``; only their bytes are read."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        tensor = self._by_name[name]
        ids = np.asarray(ids, dtype=np.int64)
        count = self.tensors[name].shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= count):
            raise ReleaseError(f"{self.path}: token id {int(ids.max())} is outside {name}'s {count} rows: the GGUF's "
                               "vocabulary does not match the release's tokenizer")
        raw = np.asarray(tensor.data[ids])
        if tensor.tensor_type == GGMLQuantizationType.F32:
            return raw.astype(np.float32, copy=False)
        return np.asarray(dequantize(raw, tensor.tensor_type), dtype=np.float32).reshape(len(ids), -1)

    def role_bytes(self) -> dict[str, Any]:
        """Stored bytes by role: ``embed_tokens``, ``lm_head`` (0 when tied), ``layers`` (per ``blk.N``) and
        ``other`` (the final norm, ...)."""
        layers: dict[int, int] = {}
        other = 0
        for tensor in self.tensors.values():
            if tensor.name in (OUTPUT, TOKEN_EMBD):
                continue
            if match := _BLOCK.match(tensor.name):
                layers[int(match.group(1))] = layers.get(int(match.group(1)), 0) + tensor.bytes
            else:
                other += tensor.bytes
        return {"embed_tokens": self.tensors[TOKEN_EMBD].bytes if TOKEN_EMBD in self.tensors else 0,
                "lm_head": self.tensors[OUTPUT].bytes if OUTPUT in self.tensors else 0,
                "layers": tuple(layers.get(i, 0) for i in range(max(layers) + 1)) if layers else (),
                "other": other}


@functools.lru_cache(maxsize=4)
def _cached(path: str, size: int, mtime_ns: int) -> GgufTable:
    return GgufTable(Path(path))


def gguf_table(path: str | Path) -> GgufTable:
    """The :class:`GgufTable` of ``path``, read once while the file is unchanged (size and modification time)."""
    path = Path(path).resolve()
    stat = path.stat()
    return _cached(str(path), stat.st_size, stat.st_mtime_ns)


_checked: set[tuple[str, int, int, str]] = set()


def checked_table(path: str | Path, release: Release) -> GgufTable:
    """:func:`~clef_local.formats.gguf_release.check_gguf` of ``path`` against ``release`` (once while the file is
    unchanged: the planner and the backend both read it on a load), then its :class:`GgufTable`."""
    from clef_local.formats.gguf_release import check_gguf

    path = Path(path).resolve()
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns, str(Path(release.path).resolve()))
    if key not in _checked:
        check_gguf(path, release)
        _checked.add(key)
    return gguf_table(path)
