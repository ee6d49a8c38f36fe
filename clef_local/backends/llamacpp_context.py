"""A GGUF backbone's per-token hidden states through llama.cpp's low-level C API (llama-cpp-python's ctypes binding).

One model, one context of our own: embeddings on, pooling none (every token's state after the final RMSNorm, what the
joint schema head reads), one sequence, ``n_ctx`` the planned context, a request decoded in chunks of ``n_batch``
tokens up to the whole context (``Llama.embed`` cuts a long request at ``n_batch`` without a word), the memory cleared
before every request. A sequence may also hold input embeddings (:meth:`LlamaCppContext.decode`: token spans and
embedding spans, e.g. a vision tower's rows at Qwen's multimodal rope positions, four per row in llama.cpp's
section-major layout). Not ``Llama(embedding=True)``: it asks for 256 sequences, so a hybrid model such as Qwen3.5
would hold 256 recurrent states. The binding's API changes between releases: the ``gguf`` extra pins it.
llama.cpp's log lines go to Python logging (:mod:`.llamacpp_log`: :data:`LOG_NAME`, the load chatter at DEBUG), not
to stderr. docs/hardware.md#llamacpp.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from clef_local.backends.llamacpp_log import LOG_NAME, llama_cpp_module
from clef_local.errors import ClefError, MaxTokensExceededError, ReleaseError
from clef_local.planning.hardware import ThreadPlan, thread_plan
from clef_local.planning.llamacpp_build import build_command

log = logging.getLogger(__name__)

KV_TYPES = ("f16", "f32")  # the KV cache's element type: f32 for exact comparisons, f16 (llama.cpp's default) else
KvType = Literal["f16", "f32"]
# Tokens per llama_decode call (n_batch = n_ubatch): the context allocates n_vocab floats of logits per token of a
# chunk besides the activations (embeddings mode still runs the LM head), 0.5 GB a chunk at Qwen3.5's 248K vocab
DEFAULT_CHUNK = 512
# the GPU builds (planning.llamacpp_build.BUILD_FLAGS) a device needs, the likeliest first
_DEVICE_BUILDS = {"cuda": ("CUDA", "ROCm", "Vulkan"), "mps": ("Metal",), "gpu": ("CUDA", "Metal", "Vulkan", "ROCm")}


class LlamaCppError(ClefError):
    """llama.cpp refused a model, a context or a decode; the message names the file and the fix."""

    status_code = 500
    error_type = "backend_error"


def gpu_layers_for(device: str, supports_gpu: bool) -> int:
    """How many layers to offload for ``device``: 0 on ``cpu``, all on ``cuda[:N]``/``mps``/``gpu`` when this
    llama.cpp build offloads; otherwise a :class:`LlamaCppError` naming the build flag."""
    kind = device.partition(":")[0]
    if kind in ("cpu", "auto", ""):
        return 0
    if kind not in ("cuda", "mps", "gpu"):
        raise LlamaCppError(f"the llamacpp backend runs on cpu, cuda[:N], mps or gpu, not {device!r}")
    if not supports_gpu:
        builds = " or ".join(f"{name}: {build_command(name)}" for name in _DEVICE_BUILDS[kind][:2])
        raise LlamaCppError(f"this llama-cpp-python was built for the CPU only, so it cannot run on {device}; "
                            f"rebuild it ({builds}) or run on --device cpu")
    return 1 << 30  # every layer (llama.cpp clamps to the model's)


@dataclass(frozen=True, eq=False)
class TokenSpan:
    """Token ids of one sequence at their 1-D positions (int32 ``[n]`` each); with M-RoPE llama.cpp gives every
    section (temporal, height, width) that position."""

    ids: np.ndarray
    positions: np.ndarray
    kind = "tokens"

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", np.ascontiguousarray(self.ids, dtype=np.int32))
        object.__setattr__(self, "positions", np.ascontiguousarray(self.positions, dtype=np.int32))
        if self.ids.ndim != 1 or self.positions.shape != self.ids.shape:
            raise ValueError(f"a token span needs ids [n] and positions [n], got {self.ids.shape} and "
                             f"{self.positions.shape}")

    def __len__(self) -> int:
        return len(self.ids)

    def triples(self) -> np.ndarray:
        """``[3, n]``: (temporal, height, width), each the token's position."""
        return np.broadcast_to(self.positions, (3, len(self.ids)))


@dataclass(frozen=True, eq=False)
class EmbeddingSpan:
    """Input embedding rows (float32 ``[n, n_embd_inp]``, e.g. a vision tower's output) at their M-RoPE positions
    (int32 ``[3, n]``: temporal, height, width; llama.cpp's fourth section is 0)."""

    rows: np.ndarray
    positions: np.ndarray
    kind = "embeddings"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", np.ascontiguousarray(self.rows, dtype=np.float32))
        object.__setattr__(self, "positions", np.ascontiguousarray(self.positions, dtype=np.int32))
        if self.rows.ndim != 2 or self.positions.shape != (3, len(self.rows)):
            raise ValueError(f"an embedding span needs rows [n, width] and positions [3, n], got {self.rows.shape} "
                             f"and {self.positions.shape}")

    def __len__(self) -> int:
        return len(self.rows)

    def triples(self) -> np.ndarray:
        return self.positions


Span = TokenSpan | EmbeddingSpan


class LlamaCppContext:
    """A GGUF backbone loaded by llama.cpp with a context for per-token hidden states.

    ``context``: tokens the longest request may have (``n_ctx``); ``chunk``: tokens per decode (at most
    ``context``); ``kv_type``: ``"f32"`` for exact comparisons with torch float32 (flash attention off too: on a
    CPU it rounds the softmax's inputs to F16), ``"f16"`` (llama.cpp's default, ~4e-2 off on SmolLM2) otherwise;
    ``threads``: the :func:`~clef_local.planning.hardware.thread_plan` of one inference thread unless given;
    ``device``: ``cpu`` or a GPU (:func:`gpu_layers_for`). Not thread-safe: one request at a time (the backend's
    callers serialise). :meth:`close` frees the context and the model.
    """

    def __init__(self, model_path: str | Path, *, context: int, chunk: int = DEFAULT_CHUNK, kv_type: KvType = "f16",
                 threads: ThreadPlan | None = None, device: str = "cpu") -> None:
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}, not {kv_type!r}")
        if context < 1 or chunk < 1:
            raise ValueError(f"context and chunk must be positive, got {context} and {chunk}")
        self._model = self._ctx = self._batch = None
        self._embd: tuple[np.ndarray, np.ndarray, Any, tuple[Any, ...]] | None = None  # made on first use
        lib = llama_cpp_module()
        self._lib = lib
        self.path = Path(model_path)
        self.kv_type: KvType = kv_type
        self.thread_plan = threads or thread_plan(workers=1)
        self.device = device

        params = lib.llama_model_default_params()
        params.n_gpu_layers = gpu_layers_for(device, bool(lib.llama_supports_gpu_offload()))
        if device.startswith("cuda:"):
            params.main_gpu = int(device.partition(":")[2] or 0)
        params.use_mmap = True
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ReleaseError(f"{self.path}: llama.cpp cannot load this GGUF (its log at DEBUG under {LOG_NAME} "
                               "says why); check the file with `clef-local verify` or export it again")
        try:
            self._open_context(context, min(chunk, context))
        except BaseException:
            self.close()
            raise
        self.hidden_size = int(lib.llama_model_n_embd_out(self._model))
        self.input_width = int(lib.llama_model_n_embd_inp(self._model))  # an embedding row's values
        # llama.cpp's n_pos_per_embd: M-RoPE (Qwen-VL) and IMROPE (Qwen3.5) take 4 positions per embedding row
        rope = int(lib.llama_model_rope_type(self._model))
        self.positions_per_embedding = 4 if rope in (lib.LLAMA_ROPE_TYPE_MROPE, lib.LLAMA_ROPE_TYPE_IMROPE,
                                                     lib.LLAMA_ROPE_TYPE_VISION) else 1
        log.debug("llama.cpp context: n_ctx %d, n_batch %d, %s KV cache, %s", self.n_ctx, self.n_batch, kv_type,
                  self.thread_plan.describe())

    def _open_context(self, context: int, chunk: int) -> None:
        lib = self._lib
        params = lib.llama_context_default_params()
        params.n_ctx = context
        params.n_batch = params.n_ubatch = chunk  # one ubatch per decode: the chunk is the whole unit of work
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = self.thread_plan.intra_op
        params.embeddings = True
        params.pooling_type = lib.LLAMA_POOLING_TYPE_NONE
        params.type_k = params.type_v = lib.GGML_TYPE_F32 if self.kv_type == "f32" else lib.GGML_TYPE_F16
        if self.kv_type == "f32":
            params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise LlamaCppError(f"{self.path}: llama.cpp could not make a context of {context:,} tokens "
                                f"({self.kv_type} KV cache; its log at DEBUG under {LOG_NAME} says why): ask for a "
                                "shorter max_length or free memory")
        self.n_ctx = int(lib.llama_n_ctx(self._ctx))
        self.n_batch = int(lib.llama_n_batch(self._ctx))
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        for i in range(self.n_batch):  # one sequence, every token an output: set once, reused by every chunk
            self._batch.n_seq_id[i] = 1
            self._batch.seq_id[i][0] = 0
            self._batch.logits[i] = 1

    @property
    def closed(self) -> bool:
        return self._model is None

    def hidden_states(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Every token's hidden state after the final norm, ``[T, hidden]`` float32, for one request's
        ``token_ids`` at positions 0 … T-1, decoded in chunks of :attr:`n_batch` from an empty memory. A request
        longer than the context is a :class:`~clef_local.errors.MaxTokensExceededError` (413), never cut."""
        ids = np.ascontiguousarray(token_ids, dtype=np.int32)
        return self.decode([TokenSpan(ids, np.arange(len(ids), dtype=np.int32))])

    def decode(self, spans: Sequence[Span]) -> np.ndarray:
        """The hidden state after the final norm of every position of one sequence made of ``spans`` (token ids and
        embedding rows, in order), ``[T, hidden]`` float32, decoded from an empty memory in chunks of at most
        :attr:`n_batch` (a chunk never mixes tokens and embeddings: each is its own batch).

        The positions must grow with the sequence, ``(temporal, height, width)`` strictly in lexicographic order (a
        token's is ``(p, p, p)``), and a token's temporal position must pass the one before it: llama.cpp masks
        attention by position (``p0 > p1``, then within one temporal position by height and width; the 2D causal
        mask of ``is_pos_2d``), so only then is its mask the sequence's causal mask that transformers applies."""
        if self._ctx is None:
            raise LlamaCppError(f"{self.path}: this llama.cpp context is closed")
        total = sum(len(span) for span in spans)
        if total == 0:
            raise ValueError("decode needs at least one token or embedding row")
        if total > self.n_ctx:
            raise MaxTokensExceededError(
                f"the request has {total:,} tokens; this llama.cpp context holds {self.n_ctx:,}: send a shorter "
                "state or load the model with a longer max_length", input_tokens=total, max_tokens=self.n_ctx)
        self._check_spans(spans)
        lib = self._lib
        out = np.empty((total, self.hidden_size), dtype=np.float32)
        lib.llama_memory_clear(lib.llama_get_memory(self._ctx), True)  # no state of the previous request remains
        start = 0
        for span in spans:
            offset = 0
            while offset < len(span):  # cut at the span's end and at the multiples of n_batch of the sequence
                n = min(len(span) - offset, (start // self.n_batch + 1) * self.n_batch - start)
                batch = self._fill(span, offset, n)
                status = lib.llama_decode(self._ctx, batch)
                if status != 0:
                    lib.llama_memory_clear(lib.llama_get_memory(self._ctx), True)
                    raise LlamaCppError(f"{self.path}: llama_decode returned {status} at positions {start:,}-"
                                        f"{start + n:,} of {total:,} ({span.kind}; 1: no KV slot, 2: aborted, <0: "
                                        f"error; its log at DEBUG under {LOG_NAME})")
                pointer = lib.llama_get_embeddings(self._ctx)
                if not pointer:
                    raise LlamaCppError(f"{self.path}: llama.cpp returned no embeddings (pooling must be none)")
                out[start:start + n] = np.ctypeslib.as_array(pointer, shape=(n * self.hidden_size,)).reshape(n, -1)
                offset += n
                start += n
        return out

    def _check_spans(self, spans: Sequence[Span]) -> None:
        """Refuse spans llama.cpp would mask otherwise than a causal sequence (:meth:`decode`), or cannot take."""
        rows = []
        for index, span in enumerate(spans):
            if isinstance(span, EmbeddingSpan):
                if self.positions_per_embedding != 4:
                    raise LlamaCppError(f"{self.path}: embedding span {index} has M-RoPE positions, but this model's "
                                        "rope is not multimodal (llama.cpp's M-RoPE / IMROPE); embeddings need a "
                                        "Qwen-VL-style backbone such as Qwen3.5")
                if span.rows.shape[1] != self.input_width:
                    raise ValueError(f"embedding span {index} has rows of {span.rows.shape[1]} values; this model "
                                     f"takes {self.input_width} (llama_model_n_embd_inp)")
            rows.append(span.triples())
        if not rows:
            return
        triples = np.concatenate(rows, axis=1).astype(np.int64)
        tokens = np.concatenate([np.full(len(s), isinstance(s, TokenSpan)) for s in spans])
        t, y, x = triples
        dt, dy, dx = np.diff(t), np.diff(y), np.diff(x)
        ordered = (dt > 0) | ((dt == 0) & ((dy > 0) | ((dy == 0) & (dx > 0))))
        ordered &= ~tokens[1:] | (dt > 0)  # llama.cpp: a token's position passes the memory's last (X < Y)
        if not ordered.all():
            i = int(np.argmin(ordered)) + 1
            raise ValueError(f"position {i} of the sequence, {tuple(int(v) for v in triples[:, i])}, does not follow "
                             f"{tuple(int(v) for v in triples[:, i - 1])}: llama.cpp's positional mask would not be "
                             "the causal mask; give positions in the sequence's order (transformers' get_rope_index)")

    def _fill(self, span: Span, offset: int, n: int) -> Any:
        """The batch of ``span``'s items ``offset`` … ``offset + n - 1``, ready to decode."""
        if isinstance(span, TokenSpan):
            batch = self._batch
            if batch is None:
                raise LlamaCppError(f"{self.path}: this llama.cpp context is closed")
            ctypes.memmove(batch.token, span.ids[offset:].ctypes.data, n * 4)
            ctypes.memmove(batch.pos, np.ascontiguousarray(span.positions[offset:offset + n]).ctypes.data, n * 4)
            batch.n_tokens = n
            return batch
        rows, positions, batch = self._embedding_batch()
        rows[:n] = span.rows[offset:offset + n]
        # section-major, as llama.cpp reads an embeddings batch: pos[j*n + i], j = temporal, height, width, 0
        positions[:4 * n].reshape(4, n)[:3] = span.positions[:, offset:offset + n]
        positions[3 * n:4 * n] = 0
        batch.n_tokens = n
        return batch

    def _embedding_batch(self) -> tuple[np.ndarray, np.ndarray, Any]:
        """The embeddings batch, made on first use: its buffers are numpy arrays of our own, since
        ``llama_batch_init`` allocates one position per row and M-RoPE rows take four."""
        if self._embd is None:
            lib, n = self._lib, self.n_batch
            rows = np.zeros((n, self.input_width), dtype=np.float32)
            positions = np.zeros(4 * n, dtype=np.int32)
            n_seq_id = np.ones(n, dtype=np.int32)
            seq = np.zeros(1, dtype=np.int32)  # every row in sequence 0
            seq_ids = (ctypes.POINTER(ctypes.c_int) * (n + 1))(*[seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int))] * n)
            outputs = np.ones(n, dtype=np.int8)  # every row an output
            batch = lib.llama_batch(
                n_tokens=0, token=None, embd=rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                pos=positions.ctypes.data_as(ctypes.POINTER(ctypes.c_int)),
                n_seq_id=n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int)),
                seq_id=ctypes.cast(seq_ids, ctypes.POINTER(ctypes.POINTER(ctypes.c_int))),
                logits=outputs.ctypes.data_as(ctypes.POINTER(ctypes.c_byte)))
            self._embd = (rows, positions, batch, (n_seq_id, seq, seq_ids, outputs))  # the buffers live with it
        rows, positions, batch, _ = self._embd
        return rows, positions, batch

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as llama.cpp read it (``general.architecture``, ...), or None."""
        if self._model is None:
            return None
        buf = ctypes.create_string_buffer(512)
        size = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if size >= 0 else None

    def describe(self) -> dict[str, Any]:
        """What llama.cpp loaded: its description, size, parameters, the context's sizes and the KV cache type."""
        lib, model = self._lib, self._model
        if model is None:
            return {"closed": True}
        buf = ctypes.create_string_buffer(256)
        lib.llama_model_desc(model, buf, len(buf))
        return {"model": buf.value.decode("utf-8", "replace"), "architecture": self.metadata("general.architecture"),
                "model_bytes": int(lib.llama_model_size(model)), "parameters": int(lib.llama_model_n_params(model)),
                "recurrent_state": bool(lib.llama_model_is_recurrent(model) or lib.llama_model_is_hybrid(model)),
                "n_ctx": self.n_ctx, "n_batch": self.n_batch, "kv_cache": self.kv_type,
                "threads": self.thread_plan.intra_op, "gpu_offload": self.device != "cpu"}

    def close(self) -> None:
        """Free the batch, the context and the model (idempotent)."""
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        self._embd = None  # numpy's buffers: freed with it
        if self._ctx is not None:
            lib.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            lib.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> LlamaCppContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
