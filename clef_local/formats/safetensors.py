"""The one reader of safetensors headers, the one dtype table, and raw arrays over a memory map (numpy only).

:func:`read_header` makes safetensors' own checks once, before any tensor is read (docs/format.md §1): a file that
fails is a one-line :class:`SafetensorsError` naming it. :data:`DTYPES` maps each dtype to its item size, stored bits
(BF16 and F8 as unsigned bit patterns) and torch name; :func:`read_arrays` maps tensors without copying them.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clef_local.errors import ReleaseError

MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
METADATA = "__metadata__"


@dataclass(frozen=True)
class Dtype:
    """One safetensors dtype: bytes per element, the numpy dtype its bits are stored as, and torch's name for it.

    ``exact`` is true when the numpy storage dtype holds the values themselves; BF16 and the F8 formats are
    stored as unsigned integers (their bit patterns) and must be decoded.
    """

    name: str
    itemsize: int
    storage: np.dtype
    torch: str
    floating: bool
    exact: bool


def _dtype(name: str, storage: str, torch: str, *, floating: bool = False, exact: bool = True) -> Dtype:
    numpy_dtype = np.dtype(storage)
    return Dtype(name, numpy_dtype.itemsize, numpy_dtype, torch, floating, exact)


# safetensors dtype name -> Dtype (every name a release or a quantized variant may hold)
DTYPES: dict[str, Dtype] = {d.name: d for d in (
    _dtype("F64", "<f8", "float64", floating=True),
    _dtype("F32", "<f4", "float32", floating=True),
    _dtype("F16", "<f2", "float16", floating=True),
    _dtype("BF16", "<u2", "bfloat16", floating=True, exact=False),
    _dtype("F8_E4M3", "u1", "float8_e4m3fn", floating=True, exact=False),
    _dtype("F8_E5M2", "u1", "float8_e5m2", floating=True, exact=False),
    _dtype("F8_E8M0", "u1", "float8_e8m0fnu", floating=True, exact=False),
    _dtype("I64", "<i8", "int64"),
    _dtype("I32", "<i4", "int32"),
    _dtype("I16", "<i2", "int16"),
    _dtype("I8", "i1", "int8"),
    _dtype("U64", "<u8", "uint64"),
    _dtype("U32", "<u4", "uint32"),
    _dtype("U16", "<u2", "uint16"),
    _dtype("U8", "u1", "uint8"),
    _dtype("BOOL", "?", "bool"),
)}  # fmt: skip


class SafetensorsError(ReleaseError):
    """A safetensors file that is not complete and consistent; ``reason`` is the message without the path."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors header: its dtype name, shape and byte span in the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes the tensor occupies in the file."""
        return self.end - self.begin

    @property
    def spec(self) -> Dtype:
        """The :class:`Dtype` of :attr:`dtype`."""
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Header:
    """A checked safetensors header: its tensors by name, the metadata, and where the data section starts."""

    path: Path
    data_start: int  # 8 + the JSON header's length
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, name: str) -> TensorInfo:
        return self.tensors[name]


def _nonnegative_ints(value: object, length: int | None = None) -> tuple[int, ...] | None:
    """``value`` as a tuple of non-negative ints (a JSON list of them, of ``length`` when given), else None."""
    if not isinstance(value, list) or (length is not None and len(value) != length):
        return None
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value):
        return None
    return tuple(value)


def _entry(path: Path, name: str, entry: object) -> TensorInfo:
    """One header entry, checked on its own: fields, dtype, and a byte span that its dtype and shape fill."""
    if not isinstance(entry, dict):
        raise SafetensorsError(path, f"garbled header entry for tensor {name!r}: not a JSON object")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in entry]
    if missing:
        raise SafetensorsError(path, f"garbled header entry for tensor {name!r}: no {', '.join(missing)}")
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SafetensorsError(path, f"tensor {name!r} has unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    shape = _nonnegative_ints(entry["shape"])
    if shape is None:
        raise SafetensorsError(path, f"garbled header entry for tensor {name!r}: shape {entry['shape']!r} is not "
                                     f"a list of non-negative integers")
    offsets = _nonnegative_ints(entry["data_offsets"], 2)
    if offsets is None or offsets[0] > offsets[1]:
        raise SafetensorsError(path, f"garbled header entry for tensor {name!r}: data_offsets "
                                     f"{entry['data_offsets']!r} are not two integers 0 <= begin <= end")
    begin, end = offsets
    need = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != need:
        raise SafetensorsError(path, f"tensor {name!r} spans {end - begin} bytes, its dtype and shape "
                                     f"({dtype} {list(shape)}) need {need}")
    return TensorInfo(dtype, shape, begin, end)


def read_header(path: str | Path) -> Header:
    """The header of the safetensors file at ``path``, checked against the file (see the module docstring);
    reads the 8-byte length and the JSON header only. Anything wrong is a :class:`SafetensorsError`."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SafetensorsError(path, f"truncated: {size} bytes, shorter than the 8-byte header length")
            if prefix[:4] == b"GGUF":  # a GGUF release's gguf/model.gguf reached a torch, MLX or ONNX path
                raise SafetensorsError(path, "a GGUF file (llama.cpp's), not safetensors: run its release with "
                                             "--backend llamacpp, or give this command the source release")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER:
                raise SafetensorsError(path, f"garbled: a header length of {header_len} bytes is not plausible "
                                             f"(safetensors allows {MAX_HEADER})")
            if 8 + header_len > size:
                raise SafetensorsError(path, f"truncated or garbled: header of {header_len} bytes does not fit "
                                             f"in {size} bytes")
            raw = f.read(header_len)
    except OSError as exc:
        raise SafetensorsError(path, f"cannot be read ({exc.strerror or exc})") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(path, f"garbled header: {exc}") from exc
    if not isinstance(header, dict):
        raise SafetensorsError(path, "garbled header: not a JSON object")
    metadata = header.pop(METADATA, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(path, f"garbled header: {METADATA} is not an object of strings")
    tensors = {name: _entry(path, name, entry) for name, entry in header.items()}
    data = size - 8 - header_len
    end, last = 0, None  # the tensors must tile the data section in offset order
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != end:
            where = f"data_offsets [{info.begin}, {info.end}]"
            after = f"tensor {last!r}, which ends at byte {end}" if last is not None else "the data section's start"
            if info.end > data:
                raise SafetensorsError(path, f"tensor {name!r} has {where}, past the end of the data section "
                                             f"({data} bytes)")
            if info.begin < end:
                raise SafetensorsError(path, f"tensor {name!r} has {where}, overlapping {after}")
            raise SafetensorsError(path, f"tensor {name!r} has {where}, leaving a gap of {info.begin - end} bytes "
                                         f"after {after}")
        end, last = info.end, name
    if data < end:
        raise SafetensorsError(path, f"truncated: data section of {data} bytes, the header's offsets need {end} "
                                     f"(tensor {last!r} ends there)")
    if data > end:
        raise SafetensorsError(path, f"data section of {data} bytes is longer than the {end} bytes the header's "
                                     f"offsets need")
    return Header(path, 8 + header_len, tensors, dict(metadata))


def read_arrays(path: str | Path, select: Callable[[str], bool] | None = None,
                header: Header | None = None) -> dict[str, np.ndarray]:
    """Every tensor of a checked safetensors file (with ``select``, those whose names it accepts) as a read-only
    numpy array over one memory map of the file, in its storage dtype (:attr:`Dtype.storage`: BF16 and F8 as
    their bit patterns). Nothing is copied; ``header`` skips reading the header again."""
    header = read_header(path) if header is None else header
    names = [name for name in header.tensors if select is None or select(name)]
    if not names:
        return {}
    try:
        mapped = np.memmap(header.path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise SafetensorsError(header.path, f"cannot be memory-mapped ({exc})") from exc
    out: dict[str, np.ndarray] = {}
    for name in names:
        info = header.tensors[name]
        span = mapped[header.data_start + info.begin : header.data_start + info.end]
        try:
            out[name] = np.asarray(span).view(info.spec.storage).reshape(info.shape)
        except ValueError as exc:  # the file changed between reading its header and mapping it
            raise SafetensorsError(header.path, f"tensor {name!r} cannot be mapped ({exc})") from exc
    return out


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """BF16 values stored as uint16 bit patterns → float32 (exact: BF16 is the top half of a float32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def read_numpy(file: str | Path, select: Callable[[str], bool] | None = None) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a numpy array (BF16 widened to float32, exactly), without torch; with
    ``select``, only the tensors whose names it accepts (the file is memory-mapped: the rest is never read). The
    header is checked first (:func:`read_header`). float8 tensors are refused: numpy has no such dtype."""
    header = read_header(file)
    out: dict[str, np.ndarray] = {}
    for name, raw in read_arrays(file, select, header=header).items():
        dtype = header[name].dtype
        if dtype == "BF16":
            out[name] = bf16_to_float32(raw)
        elif DTYPES[dtype].exact:
            out[name] = np.array(raw)  # a copy: the map is not kept open
        else:
            raise SafetensorsError(Path(file), f"tensor {name} has dtype {dtype}, which numpy cannot hold (load this "
                                   "file with torch)")
    return out
