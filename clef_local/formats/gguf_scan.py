"""A fast structural read of a GGUF file: its scalar metadata and its tensor table, arrays skipped.

gguf-py's ``GGUFReader`` builds a numpy view for every element of every array, so opening a GGUF with a 49K-token
vocabulary (the demo model's) took 5.3 s here, and Clef's 248K tokens and merges would take about five times that,
on every load. This walks the same layout (gguf-py's constants for the value types and the GGML type sizes) with
``struct`` over a memory map, stepping over arrays without materializing them: a fraction of a second. Anything that
runs past the end of the file, or names a type gguf-py does not know, is a :class:`GGUFFormatError`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class GGUFFormatError(ValueError):
    """The file is not a complete, well-formed GGUF; the message says where it stopped making sense."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the table: name, GGML type name, shape (GGUF order), absolute data offset and byte count."""

    name: str
    type: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFScan:
    """What :func:`scan` read: the version, every scalar, string and short numeric array value (``metadata``), the
    length of every array stepped over (``skipped``: the vocabulary, the merges), the tensors, where the data
    section starts and the file's size."""

    version: int
    metadata: dict[str, Any]
    skipped: dict[str, int]
    tensors: list[GGUFTensor]
    data_start: int
    size: int


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SHORT = 4096  # numeric arrays up to this length are read (recurrent layers, rope sections); longer ones skipped


class _Skipped(int):
    """The length of an array that was stepped over."""


class _Cursor:
    def __init__(self, data: Any) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> Any:
        try:
            value = struct.unpack_from(fmt, self.data, self.pos)[0]
        except struct.error:
            raise GGUFFormatError(f"cut short at byte {self.pos} of {len(self.data)}") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        if self.pos + length > len(self.data):
            raise GGUFFormatError(f"a string of {length} bytes at byte {self.pos} runs past the end")
        raw = bytes(self.data[self.pos:self.pos + length])
        self.pos += length
        return raw.decode("utf-8", "replace")

    def skip_strings(self, count: int) -> None:
        data, pos, end = self.data, self.pos, len(self.data)
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFFormatError(f"cut short at byte {pos} of {end} (in a string array)")
            pos += 8 + struct.unpack_from("<Q", data, pos)[0]
        if pos > end:
            raise GGUFFormatError(f"a string array runs past the end ({pos} > {end})")
        self.pos = pos

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item == _STRING:
                self.skip_strings(count)
                return _Skipped(count)
            if item not in _SCALARS:
                raise GGUFFormatError(f"an array of value type {item} at byte {self.pos}")
            code = _SCALARS[item]
            if count <= _SHORT:
                return [self.take(code) for _ in range(count)]
            self.pos += count * struct.calcsize(code)
            if self.pos > len(self.data):
                raise GGUFFormatError(f"an array runs past the end ({self.pos} > {len(self.data)})")
            return _Skipped(count)
        raise GGUFFormatError(f"unknown value type {kind} at byte {self.pos}")


def scan(path: str | Path) -> GGUFScan:
    """Read ``path``'s header, scalar metadata and tensor table (:class:`GGUFScan`); arrays are stepped over."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with path.open("rb") as f:
        size = path.stat().st_size
        if size < 24:
            raise GGUFFormatError(f"{size} bytes: shorter than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data)
            cursor.pos = 4  # the magic, checked by the caller
            version = cursor.take("<I")
            n_tensors, n_kv = cursor.take("<Q"), cursor.take("<Q")
            metadata: dict[str, Any] = {}
            skipped: dict[str, int] = {}
            for _ in range(n_kv):
                key = cursor.string()
                value = cursor.value(cursor.take("<I"))
                if isinstance(value, _Skipped):
                    skipped[key] = int(value)
                else:
                    metadata[key] = value
            table = []
            for _ in range(n_tensors):
                name = cursor.string()
                dims = tuple(cursor.take("<Q") for _ in range(cursor.take("<I")))
                kind, offset = cursor.take("<I"), cursor.take("<Q")
                try:
                    ggml = GGMLQuantizationType(kind)
                except ValueError:
                    raise GGUFFormatError(f"tensor {name!r} has unknown GGML type {kind}") from None
                block, type_size = GGML_QUANT_SIZES[ggml]
                count = 1
                for d in dims:
                    count *= d
                table.append((name, ggml.name, dims, offset, count // block * type_size))
            alignment = int(metadata.get("general.alignment", 32))
            start = -(-cursor.pos // alignment) * alignment
    tensors = [GGUFTensor(name, kind, dims, start + offset, nbytes) for name, kind, dims, offset, nbytes in table]
    return GGUFScan(version, metadata, skipped, tensors, start, size)
