"""The one GGUF header reader: a GGUF file's metadata and tensor table, and the rows of one tensor. What
:func:`clef_local.formats.gguf_release.check_gguf` checks before llama.cpp parses the file, what the planner counts
(bytes per role, the tensor types the file really holds) and the output-embedding rows the joint schema head reads.

The header is read here rather than with gguf-py's ``GGUFReader``: that reader builds a numpy view per element of
every metadata array, 5-8 s for the demo model's 49K-token vocabulary and merges on a busy 2-core machine and about
five times that at Qwen3.5's 248K vocabulary, on every load. Here string arrays are stepped over by their lengths and
numeric arrays by their size (GGUF v2/v3, little-endian; gguf-py's enums and block sizes name the types), over a
memory map: tens of milliseconds. Only the rows asked for are read from a tensor and dequantized by gguf-py
(:meth:`GgufTable.rows`). A file that does not parse (not a GGUF, another version, cut short, a type gguf-py does not
know) is a one-line :class:`~clef_local.errors.ReleaseError` naming it. The checks against a release are
:func:`clef_local.formats.gguf_release.check_gguf`'s; ``gguf_release.checked_table`` runs them, then returns the
table.
"""

from __future__ import annotations

import functools
import mmap
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clef_local.errors import ReleaseError

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # the versions llama.cpp reads (gguf.h: GGUF_VERSION 3; 2 still loads)
OUTPUT = "output.weight"  # llama.cpp's lm_head
TOKEN_EMBD = "token_embd.weight"  # the input embedding, the lm_head too when tied (no output.weight)
_BLOCK = re.compile(r"^blk\.(\d+)\.")
# GGUFValueType -> struct format of one scalar (STRING 8 and ARRAY 9 are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_HEADER = 24  # magic, version, tensor count, metadata count


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the table: its GGML type name (``Q4_K``, ``F32``, ...), numpy-order shape, stored bytes and
    where its data starts in the file (absolute)."""

    name: str
    type: str
    shape: tuple[int, ...]
    bytes: int
    offset: int


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array, not read: its element type and length."""

    type: int
    length: int


class _Incomplete(Exception):
    """Where the header stopped making sense; :class:`GgufTable` turns it into one ReleaseError naming the file."""


class _Cursor:
    def __init__(self, buffer: Any) -> None:
        self.buffer, self.pos = buffer, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buffer):
            raise _Incomplete(f"cut short at byte {self.pos} of {len(self.buffer)}")
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.take("<Q")
        end = self.pos + length
        if end > len(self.buffer):
            raise _Incomplete(f"at byte {self.pos} a string of {length} bytes runs past the end")
        text = bytes(self.buffer[self.pos:end]).decode("utf-8", "replace")
        self.pos = end
        return text

    def skip_strings(self, count: int) -> None:
        # one tight loop over locals: the vocabulary and the merges are hundreds of thousands of strings
        buffer, pos, end = self.buffer, self.pos, len(self.buffer)
        for _ in range(count):
            if pos + 8 > end:
                raise _Incomplete(f"at byte {pos} a string array runs past the end")
            pos += 8 + struct.unpack_from("<Q", buffer, pos)[0]
        self.pos = pos

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, length = self.take("<I"), self.take("<Q")
            if item == _STRING:
                self.skip_strings(length)
            elif item in _SCALARS:
                self.pos += struct.calcsize(_SCALARS[item]) * length
            else:
                raise _Incomplete(f"an array of value type {item} at byte {self.pos}, not a GGUF type")
            if self.pos > len(self.buffer):
                raise _Incomplete(f"at byte {self.pos} of {len(self.buffer)} an array runs past the end")
            return ArrayInfo(item, length)
        if kind not in _SCALARS:
            raise _Incomplete(f"value type {kind} at byte {self.pos}, not a GGUF type")
        return self.take(_SCALARS[kind])


def _check_start(path: Path, head: bytes) -> None:
    """The magic and the version (the first 8 bytes), each refused in its own words."""
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise ReleaseError(f"{path}: not a GGUF file (starts with {head[:4]!r}, not {GGUF_MAGIC!r}); export one "
                           f"with clef-local export-gguf")
    version = struct.unpack("<I", head[4:8])[0]
    if version not in GGUF_VERSIONS:
        raise ReleaseError(f"{path}: GGUF version {version}, llama.cpp reads {' or '.join(map(str, GGUF_VERSIONS))}"
                           f"; re-export it with clef-local export-gguf")


class GgufTable:
    """A GGUF's version, metadata (arrays as :class:`ArrayInfo`: type and length, not their items), tensor table,
    where the data section starts (``data_start``) and the file's size (``size``)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

        self.path = path
        with path.open("rb") as f:
            _check_start(path, f.read(8))
            self.size = path.stat().st_size
            if self.size < _HEADER:
                raise ReleaseError(f"{path}: not a complete GGUF file ({self.size} bytes, shorter than a GGUF header)"
                                   f"; the file is truncated or damaged, copy or re-export it")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cursor = _Cursor(self._map)
        cursor.pos = 4  # the magic, checked above
        try:
            self.version = cursor.take("<I")
            tensor_count, kv_count = cursor.take("<Q"), cursor.take("<Q")
            self.metadata: dict[str, Any] = {}
            for _ in range(kv_count):
                key = cursor.string()
                self.metadata[key] = cursor.value(cursor.take("<I"))
            infos = []
            for _ in range(tensor_count):
                name = cursor.string()
                dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
                infos.append((name, dims, cursor.take("<I"), cursor.take("<Q")))
        except _Incomplete as exc:
            raise ReleaseError(f"{path}: not a complete GGUF file ({exc}); the file is truncated or damaged, copy or "
                               f"re-export it") from None
        alignment = int(self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        self.data_start = -(-cursor.pos // alignment) * alignment
        self.tensors: dict[str, GgufTensor] = {}
        for name, dims, kind, offset in infos:
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError as exc:
                raise ReleaseError(f"{path}: tensor {name!r} has GGML type {kind}, which gguf-py does not know; "
                                   "update the gguf package or re-export the file") from exc
            block, size = GGML_QUANT_SIZES[qtype]
            shape = tuple(int(d) for d in reversed(dims))
            self.tensors[name] = GgufTensor(name, qtype.name, shape, int(np.prod(shape)) * size // block,
                                            self.data_start + offset)
        self.architecture = str(self.metadata.get("general.architecture"))

    def field(self, key: str) -> Any:
        """A metadata value (an array as :class:`ArrayInfo`), None when absent."""
        return self.metadata.get(key)

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

    def check_extent(self) -> None:
        """Refuse a file whose tensor data does not all lie within it (a truncated file), in one line."""
        for tensor in self.tensors.values():
            self._within(tensor)

    def _within(self, tensor: GgufTensor) -> None:
        end = tensor.offset + tensor.bytes
        if end > self.size:
            raise ReleaseError(f"{self.path}: tensor {tensor.name!r} ends at byte {end}, the file has {self.size} "
                               f"(truncated); copy or re-export it")

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of tensor ``name`` as float32 ``[len(ids), columns]``; only their bytes are read."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        ids = np.asarray(ids, dtype=np.int64)
        count = tensor.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= count):
            raise ReleaseError(f"{self.path}: token id {int(ids.max())} is outside {name}'s {count} rows: the GGUF's "
                               "vocabulary does not match the release's tokenizer")
        self._within(tensor)
        row_bytes = tensor.bytes // count
        table = np.frombuffer(self._map, dtype=np.uint8, count=tensor.bytes, offset=tensor.offset)
        raw = table.reshape(count, row_bytes)[ids]
        qtype = GGMLQuantizationType[tensor.type]
        if qtype == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(len(ids), -1).copy()
        return np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(len(ids), -1)

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
