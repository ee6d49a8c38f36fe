"""Streaming a release's shards into a variant's: each weight quantized (or kept) as it is read, each output shard
written — and hashed for the manifest — on one background thread while the next is quantized
(:func:`quantize_shards`), with the helpers every export shares — row-block quantization, freeing heap memory, the
umask's file mode, the shard index, and whether a source already lies on a 4-bit grid. Used by :mod:`.quantize` (one
scheme) and :mod:`.mixed` (a scheme per layer group).

Memory: at most one write is in flight (the next shard is handed over only once the previous one is on disk), so the
peak is the shard being quantized and its quantized copy plus at most one more quantized output shard, the one being
written. The bytes written are those of writing each shard in turn (:data:`BACKGROUND_WRITES`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from clef_local.export.staging import ExportError
from clef_local.formats.manifest import file_entries
from clef_local.quant import registry

if TYPE_CHECKING:
    import torch

    from clef_local.quant import Scheme

log = logging.getLogger(__name__)

# Per-row schemes are quantized in row blocks of about this many elements: bit-identical to one call, the
# scheme's float32/int64 temporaries stay a few MB whatever the tensor, and cache-sized blocks run faster than one
# call (docs/benchmarks.md, export size and memory).
CHUNK_ELEMENTS = 1 << 18
ROW_WISE = frozenset(registry.names_where(lambda row: row.row_wise))
ROW_BLOCK = 8
FOUR_BIT_TOLERANCE = 1e-2  # relative error of an int4 g32 round trip below which a source counts as 4-bit already
INDEX = "model.safetensors.index.json"
PLAN_KEPT = "kept in the source precision by the mixed-precision plan"
Picked = tuple["Scheme", "int | None", "dict[str, Any]"]  # (scheme, group size, options) of one weight
# Write (and hash) each output shard on one background thread while the next is quantized; False writes each in turn
# on the calling thread, as before (the tests compare the two byte for byte).
BACKGROUND_WRITES = True
WRITER_THREAD = "clef-shard-writer"


def file_mode() -> int:
    """0o666 less the process umask (what ``open()`` would give a new file)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def quantize_tensor(scheme: Scheme, weight: torch.Tensor, group: int | None, **options: Any
                    ) -> dict[str, torch.Tensor]:
    """``scheme.quantize(weight, group, **options)``, in row blocks of ~:data:`CHUNK_ELEMENTS` for the per-row schemes
    (int4 groups run along a row, int8/fp8 scale each row: the blocks' outputs join to the same tensors,
    :meth:`Scheme.join_rows`); nf4 (blocks over the flattened weight, one serialized state) in one call."""
    # a multiple of 8 rows: the pack-quantized layout packs 8 rows' zero points per word
    rows = max(ROW_BLOCK, CHUNK_ELEMENTS // max(1, weight.shape[-1]) // ROW_BLOCK * ROW_BLOCK)
    if not scheme.row_wise or weight.dim() != 2 or weight.shape[0] <= rows:
        return scheme.quantize(weight, group, **options)
    return scheme.join_rows([scheme.quantize(weight[i : i + rows], group, **options)
                             for i in range(0, weight.shape[0], rows)])


_LIBC: Any = None


def release_memory() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    glibc raises its mmap threshold after large frees, so later transient buffers come from the heap, where the
    small long-lived outputs between them keep the freed space resident: without this, a one-shard export's RSS
    grows to a multiple of the shard (docs/benchmarks.md, export size and memory).
    """
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 (raises AttributeError off glibc)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def write_shard(tensors: dict[str, torch.Tensor], tmp: Path, shard: str, metadata: dict[str, str] | None,
                mode: int) -> dict[str, Any]:
    """Save one output shard into ``tmp`` with ``mode`` (:func:`file_mode`) and return its manifest entry (size,
    SHA-256): hashed here, while its pages are still in the page cache, rather than read back from disk when the
    manifest is written. ``tensors`` is emptied once written."""
    path = tmp / shard
    save_shard(tensors, path, metadata)
    os.chmod(path, mode)  # safetensors writes 0600; give shards the umask's mode
    log.debug("wrote %s (%d tensors)", shard, len(tensors))
    # freed now, before the hash, not whenever the thread pool lets go of the task's arguments
    tensors.clear()
    return file_entries(tmp, [shard])[shard]


class ShardWriter:
    """Writes output shards (:func:`write_shard`) one at a time: on one background thread when ``background``, else
    on the calling thread. :meth:`submit` waits for the previous write before handing over the next, so at most one
    quantized shard waits to be written besides the one being built. ``files``: the written shards' manifest entries.

    A write's error is raised by the next :meth:`check`, :meth:`submit` or :meth:`wait`, as the exception
    :func:`save_shard` raised. Leaving the ``with`` block, on success or on an exception, waits for the write in
    flight and stops the thread: nothing writes into the staging directory after, so its removal is final."""

    def __init__(self, tmp: Path, background: bool) -> None:
        self.tmp = tmp
        # read here, on the calling thread: file_mode sets the process-wide umask for a moment
        self.mode = file_mode()
        self.files: dict[str, dict[str, Any]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=WRITER_THREAD) if background else None
        self._pending: tuple[str, Future[dict[str, Any]]] | None = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._pool is None:
            return
        self._pool.shutdown(wait=True)  # the thread ends only once the write in flight has
        if exc is not None and self._pending is not None and (error := self._pending[1].exception()) is not None:
            # the main thread's exception is the one raised; the writer's is only recorded
            log.debug("writing %s failed as well: %s", self._pending[0], error)

    def submit(self, shard: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> None:
        """Write ``tensors`` as ``shard`` (in the background: after the previous write has finished)."""
        self.wait()
        if self._pool is None:
            self.files[shard] = write_shard(tensors, self.tmp, shard, metadata, self.mode)
        else:
            self._pending = shard, self._pool.submit(write_shard, tensors, self.tmp, shard, metadata, self.mode)

    def check(self) -> None:
        """Raise a finished write's error now (a full disk stops the export at the next tensor, not a shard later)."""
        if self._pending is not None and self._pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Wait for the write in flight, if any; raise its error or record its entry."""
        if self._pending is None:
            return
        shard, future = self._pending
        self._pending = None
        self.files[shard] = future.result()
        release_memory()  # the written shard's tensors, freed by the writer, back to the OS


def quantize_shards(source: Path, tmp: Path, shards: list[str], scheme: Scheme | None, group: int | None,
                    options: dict[str, Any], precomputed: dict[str, dict[str, torch.Tensor]] | None = None,
                    on_tensor: Callable[[str], None] | None = None, *,
                    choose: Callable[[str], Picked | None] | None = None) -> dict[str, Any]:
    """Stream every source shard into the same-named output shard; return what was quantized and the sizes.

    ``precomputed`` (``--calibrate``): packed tensors per weight name, written instead of round-to-nearest; every
    quantized weight must have one and every one must be used. ``choose`` (a mixed-precision plan,
    :mod:`clef_local.export.mixed`): the ``(scheme, group, options)`` of each weight the predicate would quantize,
    or None to keep it in the source precision; ``scheme``, ``group`` and ``options`` are then unused.

    Each output shard is written while the next is quantized (:class:`ShardWriter`, :data:`BACKGROUND_WRITES`); the
    record's ``files`` holds their manifest entries ``{shard: {"size", "sha256"}}``, hashed as they were written."""
    from safetensors import safe_open
    from tqdm import tqdm

    from clef_local.quant.predicate import should_quantize

    if scheme is None and choose is None:
        raise ValueError("quantize_shards needs a scheme or a choose function")
    pred_group = scheme.predicate_group_size(group) if scheme is not None else None
    total = sum(len(safe_open(str(source / shard), framework="pt").keys()) for shard in shards)
    quantized: list[str] = []
    skipped: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    sizes: Counter[str] = Counter()
    params = 0
    with tqdm(total=total, unit="tensor", disable=None, dynamic_ncols=True) as bar, \
            ShardWriter(tmp, BACKGROUND_WRITES) as writer:
        for shard in shards:
            bar.set_description(shard)
            out: dict[str, torch.Tensor] = {}
            with safe_open(str(source / shard), framework="pt") as f:
                metadata = f.metadata()
                for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                    writer.check()
                    # a view of the mapped file: its pages are read (with the kernel's readahead) as the scheme first
                    # touches them, so there is nothing for a reader thread to overlap short of copying the next
                    # tensor in, one tensor more of peak for a read a few % of int4's time
                    tensor = f.get_tensor(name)
                    nbytes = tensor.numel() * tensor.element_size()
                    ok, reason = should_quantize(name, tuple(tensor.shape), pred_group)
                    spec, spec_group, spec_options = scheme, group, options
                    if ok and choose is not None:
                        picked = choose(name)
                        if picked is None:
                            ok, reason = False, PLAN_KEPT
                        else:
                            spec, spec_group, spec_options = picked
                            ok, reason = should_quantize(name, tuple(tensor.shape),
                                                         spec.predicate_group_size(spec_group))
                    if ok and spec is not None:
                        prefix = name.removesuffix(".weight")
                        if precomputed is None:
                            tensors = quantize_tensor(spec, tensor, spec_group, **spec_options)
                        elif name in precomputed:
                            tensors = precomputed.pop(name)
                        else:
                            raise ExportError(f"calibration produced no tensors for {name} ({source / shard})")
                        packed = {f"{prefix}.{k}": v.contiguous() for k, v in tensors.items()}
                        quantized.append(name)
                        params += tensor.numel()
                        sizes["linear_before"] += nbytes
                        sizes["linear_after"] += sum(v.numel() * v.element_size() for v in packed.values())
                    else:
                        packed = {name: tensor}
                        skipped[name] = reason
                    for key, value in packed.items():
                        if key in out or key in weight_map:
                            raise ExportError(f"{source / shard}: output tensor {key} would be written twice")
                        out[key] = value
                        weight_map[key] = shard
                        sizes["tensor_after"] += value.numel() * value.element_size()
                    del tensor, packed
                    if ok:
                        release_memory()
                    bar.update()
                    if on_tensor is not None:
                        on_tensor(name)
            # the kept tensors are views of the source's mapping, which they keep alive after the handle closes
            writer.submit(shard, out, metadata)
            del out  # the writer holds the shard until it is on disk
            release_memory()
        writer.wait()
    if precomputed:
        raise ExportError(f"calibrated weights not found in {source}: {', '.join(sorted(precomputed)[:5])}")
    return {"quantized": quantized, "skipped": skipped, "weight_map": weight_map, "sizes": dict(sizes),
            "params": params, "files": writer.files}


def save_shard(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None) -> None:
    """``safetensors.torch.save_file``, with its I/O failures raised as the ``OSError`` they are (safetensors reports
    a full disk as ``SafetensorError("... No space left on device (os error 28)")``), so the export names them."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        if match := re.search(r"os error (\d+)", str(exc)):
            code = int(match[1])
            raise OSError(code, os.strerror(code), str(path)) from exc
        raise


def first_quantized_weight(source: Path, shards: list[str]) -> torch.Tensor | None:
    """The first weight of the source that int4 g32 would quantize (it stands for the rest in :func:`already_4bit`);
    reads that one tensor only."""
    from safetensors import safe_open

    from clef_local.quant.predicate import should_quantize

    for shard in shards:
        with safe_open(str(source / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                if should_quantize(name, tuple(f.get_slice(name).get_shape()), 32)[0]:
                    return f.get_tensor(name)
    return None


def already_4bit(weight: torch.Tensor) -> bool:
    """Whether a 2-D weight already lies on a 4-bit affine grid per 32 input columns — a dequantized GGUF
    Q4_0/Q4_1 model, such as the demo backbone: int4 g32 (mse grid) then gives it back up to its dtype's rounding
    (an order of magnitude below Gaussian weights' error, docs/benchmarks.md, int4 grids)."""
    import torch

    from clef_local.quant import int4

    if weight.dim() != 2 or weight.shape[1] % 32 or not weight.is_floating_point():
        return False
    sample = weight[:256]  # rows are independent; a few hundred decide it
    norm = float(sample.float().norm())
    if norm == 0:  # an all-zero block says nothing about the model
        return False
    back = int4.dequantize(int4.quantize(sample, 32), 32, torch.float32)
    return float((back - sample.float()).norm()) <= FOUR_BIT_TOLERANCE * norm


def write_index(source: Path, tmp: Path, result: dict[str, Any]) -> None:
    index = json.loads((source / INDEX).read_text(encoding="utf-8"))
    index["metadata"] = {**(index.get("metadata") or {}), "total_size": result["sizes"]["tensor_after"]}
    index["weight_map"] = dict(sorted(result["weight_map"].items()))
    (tmp / INDEX).write_text(json.dumps(index, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
