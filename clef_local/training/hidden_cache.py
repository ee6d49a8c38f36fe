"""The caches of head training: what a frozen backbone computes, once per record (:func:`cache_hidden_states`,
:func:`question_means`), in blocks named by the hash of their token ids and the compute dtype and written
atomically: a larger training set reuses a smaller one's blocks, a killed run resumes at the first missing block,
and a stale cache cannot be picked up by mistake.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from clef_local.formats.release import read_json
from clef_local.runtime.encoding import EncodedRecord

log = logging.getLogger(__name__)


BLOCK_RECORDS = 256  # cache unit: a larger training set reuses every block it shares with a smaller one
MEANS_BLOCK_RECORDS = 512  # the span means are small: larger blocks, fewer files


def cache_dtype(device: str) -> torch.dtype:
    """The backbone's compute dtype for caching: BF16 where it is the fast path (accelerators; a CPU where it was
    measured faster, :mod:`clef_local.planning.dtype_probe`)."""
    if device != "cpu":
        return torch.bfloat16
    from clef_local.planning.hardware import detect_cpu

    return torch.bfloat16 if detect_cpu(measure_bf16=True).fast_bf16 else torch.float32


def block_name(block: Sequence[EncodedRecord], dtype: torch.dtype = torch.float32) -> str:
    """A block's cache directory is named by its token ids (and a non-float32 compute dtype; float32 names are
    those of older caches), so a stale cache cannot be picked up by mistake."""
    digest = hashlib.sha256()
    for record in block:
        digest.update(np.asarray(record.input_ids, dtype=np.int64).tobytes())
        digest.update(b"|")
    if dtype != torch.float32:
        digest.update(str(dtype).encode())
    return f"block-{digest.hexdigest()[:16]}"


def cache_hidden_states(backbone_dir: Path, encoded: Sequence[EncodedRecord], cache: Path, *,
                        device: str = "cpu", block_records: int = BLOCK_RECORDS) -> list[torch.Tensor]:
    """Hidden states ``[T, hidden]`` (stored BF16) of every record, computed once and kept in ``cache``.

    Records are cached in blocks of ``block_records`` consecutive records, each in a directory named by the hash of
    its token ids (and the compute dtype): growing the training set (or resuming a killed run) computes only the
    blocks not yet there. The backbone computes in BF16 on an accelerator and on a CPU with AMX (well over twice as
    fast as float32 there, docs/benchmarks.md#head-training), else in float32 (faster than BF16 without AMX). BF16
    is also what ``clef_local.load`` runs there, so the head trains on the hidden states it will see.
    """
    from clef_local.backends.torch_backend import TorchBackbone

    dtype = cache_dtype(device)
    blocks = [list(range(s, min(s + block_records, len(encoded)))) for s in range(0, len(encoded), block_records)]
    names = [block_name([encoded[i] for i in block], dtype) for block in blocks]
    todo = [b for b, name in enumerate(names) if not (cache / name / "done").is_file()]
    backbone = None
    if todo:
        config = read_json(backbone_dir / "config.json")
        backbone = TorchBackbone(backbone_dir, config, device=device, dtype=dtype)
        tokens = sum(len(encoded[i].input_ids) for b in todo for i in blocks[b])
        log.info("caching hidden states: %d of %d blocks to compute (%d tokens)", len(todo), len(blocks), tokens)
    started = time.perf_counter()
    for b in tqdm(todo, desc="caching hidden states", unit="block"):
        _cache_block(backbone, [encoded[i] for i in blocks[b]], cache / names[b],
                     batch_tokens=4096 if device == "cpu" else 16384)
    if todo:
        log.info("cached %d blocks in %.0f s", len(todo), time.perf_counter() - started)
    hidden: list[torch.Tensor] = []
    for block, name in zip(blocks, names, strict=True):
        hidden += _load_block(cache / name, len(block))
    return hidden


def _cache_block(backbone, records: Sequence[EncodedRecord], directory: Path, *, batch_tokens: int,
                 chunk_tokens: int = 65536) -> None:
    """One block: chunks of similar-length records written atomically, then a ``done`` marker."""
    from clef_local.backends.torch_pass import collate

    directory.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(records)), key=lambda i: len(records[i].input_ids))
    chunks: list[list[int]] = [[]]
    for i in order:  # chunks of similar lengths, about chunk_tokens each
        if chunks[-1] and sum(len(records[j].input_ids) for j in chunks[-1]) >= chunk_tokens:
            chunks.append([])
        chunks[-1].append(i)
    for c, members in enumerate(chunks):
        path = directory / f"chunk-{c:05d}.safetensors"
        if path.is_file():
            continue
        tensors = {}
        for batch in token_batches(members, records, batch_tokens):
            ids, mask = collate([records[i] for i in batch], 0, backbone.device)
            hidden = backbone.forward(ids, mask).to(torch.bfloat16).cpu()
            for row, i in enumerate(batch):
                tensors[str(i)] = hidden[row, : len(records[i].input_ids)].contiguous()
        tmp = directory / f".{path.name}.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, path)  # atomic: a killed run leaves no half chunk
    (directory / "done").write_text(f"{len(records)}\n")


def token_batches(order: Sequence[int], records: Sequence[EncodedRecord], batch_tokens: int) -> Iterator[list[int]]:
    """Consecutive runs of ``order`` (indices of ``records`` by growing length) whose padded size — the run's count
    times its last, longest record — stays within ``batch_tokens``; a record longer than that goes alone."""
    start = 0
    while start < len(order):
        size = 1
        while (start + size < len(order)
               and (size + 1) * len(records[order[start + size]].input_ids) <= batch_tokens):
            size += 1
        yield list(order[start : start + size])
        start += size


def _load_block(directory: Path, size: int) -> list[torch.Tensor]:
    hidden: list[torch.Tensor | None] = [None] * size
    for path in sorted(directory.glob("chunk-*.safetensors")):
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as error:
            raise RuntimeError(f"{path}: unreadable cache chunk ({error}); delete it and run again") from error
        for key, value in tensors.items():
            hidden[int(key)] = value
    if any(h is None for h in hidden):
        raise RuntimeError(f"{directory}: cache block is incomplete; delete it and run again")
    return hidden


def truncate_to_questions(record: EncodedRecord) -> EncodedRecord:
    """``record`` cut after its last question span: all its question-span means read."""
    return replace(record, input_ids=record.input_ids[:max(q.question_span[1] for q in record.questions)])


def _means_blocks(encoded: Sequence[EncodedRecord], device: str, block_records: int
                  ) -> tuple[torch.dtype, list[EncodedRecord], list[list[int]], list[str]]:
    dtype = cache_dtype(device)
    cut = [truncate_to_questions(r) for r in encoded]
    blocks = [list(range(s, min(s + block_records, len(cut)))) for s in range(0, len(cut), block_records)]
    return dtype, cut, blocks, [_means_block_name([cut[i] for i in block], dtype) for block in blocks]


def question_means(backbone_dir: Path, encoded: Sequence[EncodedRecord], cache: Path, *, device: str = "cpu",
                   block_records: int = MEANS_BLOCK_RECORDS) -> list[np.ndarray]:
    """Per record, ``[questions, hidden]`` float32 span means of the un-affine layer norm of the final hidden
    states, computed on the records cut after their last question span and cached in blocks named by their token
    ids and dtype (written atomically: a killed run resumes at the first missing block)."""
    from clef_local.backends.torch_backend import TorchBackbone

    dtype, cut, blocks, names = _means_blocks(encoded, device, block_records)
    todo = [b for b, name in enumerate(names) if not (cache / name).is_file()]
    if todo:
        backbone = TorchBackbone(backbone_dir, read_json(backbone_dir / "config.json"), device=device, dtype=dtype)
        tokens = sum(len(cut[i].input_ids) for b in todo for i in blocks[b])
        log.info("question-span means: %d of %d blocks to compute (%d tokens)", len(todo), len(blocks), tokens)
        cache.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        for b in tqdm(todo, desc="question-span means", unit="block"):
            means = _block_means(backbone, [cut[i] for i in blocks[b]], 4096 if device == "cpu" else 16384)
            tmp = cache / f".{names[b]}.tmp"
            save_file({str(n): m for n, m in enumerate(means)}, str(tmp))
            os.replace(tmp, cache / names[b])
        log.info("computed %d blocks in %.0f s", len(todo), time.perf_counter() - started)
    out: list[np.ndarray] = []
    for block, name in zip(blocks, names, strict=True):
        try:
            stored = load_file(str(cache / name))
        except (SafetensorError, OSError) as error:
            raise RuntimeError(f"{cache / name}: unreadable cache block ({error}); delete it and run again") from error
        if len(stored) != len(block):
            raise RuntimeError(f"{cache / name}: holds {len(stored)} records, expected {len(block)}; delete it")
        out += [stored[str(n)].numpy() for n in range(len(block))]
    return out


def _means_block_name(block: Sequence[EncodedRecord], dtype: torch.dtype) -> str:
    digest = hashlib.sha256(str(dtype).encode())
    for record in block:
        digest.update(np.asarray(record.input_ids, dtype=np.int64).tobytes())
        for question in record.questions:
            digest.update(np.asarray(question.question_span, dtype=np.int64).tobytes())
        digest.update(b"|")
    return f"means-{digest.hexdigest()[:16]}.safetensors"


@torch.inference_mode()
def _block_means(backbone, records: Sequence[EncodedRecord], batch_tokens: int) -> list[torch.Tensor]:
    from clef_local.backends.torch_pass import collate

    means: list[torch.Tensor | None] = [None] * len(records)
    order = sorted(range(len(records)), key=lambda i: len(records[i].input_ids))
    for batch in token_batches(order, records, batch_tokens):
        ids, mask = collate([records[i] for i in batch], 0, backbone.device)
        hidden = backbone.forward(ids, mask).float()
        normed = F.layer_norm(hidden, hidden.shape[-1:])
        for row, i in enumerate(batch):
            means[i] = torch.stack([normed[row, a:b].mean(0) for a, b in
                                    (q.question_span for q in records[i].questions)]).cpu().contiguous()
    return cast(list[torch.Tensor], means)
