"""Memory of a GGUF backbone on llama.cpp (the ``llamacpp`` backend) and the loader's decision for it: pure
arithmetic on the file's tensor table (:mod:`clef_local.formats.gguf_tensors`) and the release's shapes.

llama.cpp allocates everything when its context is made, so the plan counts, at the planned context: the GGUF's
tensors as stored (memory-mapped, resident once read), the KV cache (F16, or F32 for exact runs) of the attention
layers, the recurrent state of the linear-attention layers (F32, one sequence), the compute buffer of one decode
chunk — its logits (embeddings mode still runs the LM head: ``chunk × vocab`` floats twice, the graph's and the
output buffer), its mask over the context and, without flash attention (the F32 mode), its attention scores over the
context; then the joint schema head in numpy over the whole context, the runtime overhead and the margin.
docs/hardware.md#llamacpp.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_local.errors import ApiUsageError, InsufficientMemoryError
from clef_local.planning.choice import LoadDecision, as_cpu
from clef_local.planning.estimate import MARGIN, RUNTIME_OVERHEAD, ModelDims, linear_state_bytes
from clef_local.units import GiB, MiB

if TYPE_CHECKING:
    from clef_local.formats.release import Release
    from clef_local.planning.hardware import Hardware
    from clef_local.planning.load_options import LoadOptions

log = logging.getLogger(__name__)

BACKEND = "llamacpp"
KERNEL = "llama.cpp"
KV_BYTES = {"float16": 2, "float32": 4}  # the KV cache's element: --dtype float32 asks for the exact F32 one
LOGITS_BUDGET = 256 * MiB  # the chunk's logits (graph + output buffer) at most this: 256 tokens at a 248K vocab
CHUNK_STEP, MAX_CHUNK = 64, 512  # past 512 tokens a decode chunk is no faster on a CPU
CTX_PAD = 256  # llama.cpp rounds n_ctx up to this


def kv_dtype(dtype: Any) -> str:
    """The KV cache's dtype for a ``dtype`` option: ``float32`` when asked for (exact), else ``float16``."""
    return "float32" if str(dtype).removeprefix("torch.") == "float32" else "float16"


def chunk_for(vocab: int) -> int:
    """Tokens per llama.cpp decode: at most :data:`MAX_CHUNK`, fewer where the chunk's logits pass
    :data:`LOGITS_BUDGET`, a multiple of :data:`CHUNK_STEP`, at least one step."""
    fitting = LOGITS_BUDGET // (2 * 4 * max(1, vocab))
    return max(CHUNK_STEP, min(MAX_CHUNK, fitting // CHUNK_STEP * CHUNK_STEP))


@dataclass(frozen=True)
class GgufFootprint:
    """What the planner knows of a GGUF release: the file's stored bytes by role and tensor types, and the shapes."""

    name: str
    path: Path
    architecture: str  # llama.cpp's (``llama``, ``qwen35``)
    file_type: str | None
    type_counts: dict[str, int]
    embed_tokens: int
    lm_head: int  # 0 when tied
    layers: tuple[int, ...]
    other: int
    file_bytes: int
    vocab: int
    head: int  # the joint schema head in float32
    dims: ModelDims

    @property
    def weights(self) -> int:
        return self.embed_tokens + self.lm_head + sum(self.layers) + self.other

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path), "dims": asdict(self.dims), "weights": self.weights}


def gguf_footprint(release: Release, path: Path | None = None) -> GgufFootprint:
    """The footprint of the release's GGUF (``path``, default ``release.gguf``) from its tensor table, once the file
    passed :func:`~clef_local.formats.gguf_release.check_gguf`."""
    from clef_local.formats.gguf_release import checked_table
    from clef_local.formats.gguf_tensors import TOKEN_EMBD
    from clef_local.formats.head_config import head_tensor_shapes

    path = path or release.gguf
    if path is None:
        raise ApiUsageError(f"{release.path} has no gguf/model.gguf; write one with `clef-local export-gguf --model "
                            f"{release.path} --out DIR` and load DIR")
    table = checked_table(path, release)  # a bad file is named here, before anything else reads it
    roles = table.role_bytes()
    head = 4 * sum(_count(shape) for shape in head_tensor_shapes(release.head_config).values())
    vocab = table.tensors[TOKEN_EMBD].shape[0] if TOKEN_EMBD in table.tensors else int(
        release.text_config.get("vocab_size") or 0)
    return GgufFootprint(name=release.path.name, path=Path(path), architecture=table.architecture,
                         file_type=table.file_type, type_counts=table.type_counts,
                         embed_tokens=roles["embed_tokens"], lm_head=roles["lm_head"], layers=roles["layers"],
                         other=roles["other"], file_bytes=Path(path).stat().st_size, vocab=vocab, head=head,
                         dims=ModelDims.from_config(release.config, head_width=release.head_config.width))


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class GgufPlan:
    """One GGUF on one device at ``context`` tokens, term by term (bytes)."""

    footprint: GgufFootprint
    hardware: Hardware
    context: int  # as llama.cpp sizes it (rounded up to CTX_PAD)
    kv_dtype: str
    chunk: int
    weights: int
    kv_cache: int
    recurrent: int
    compute: int
    head: int
    overhead: int
    margin: int
    offloaded: bool  # weights, KV and compute on a GPU; the head and its inputs in host memory

    @property
    def need(self) -> int:
        """Bytes on the device (CPU and Apple: the one pool): with the head when it shares it."""
        device = self.weights + self.kv_cache + self.recurrent + self.compute + self.overhead + self.margin
        return device + (0 if self.offloaded and not self.hardware.shares_host_memory else self.head)

    @property
    def available(self) -> int:
        return self.hardware.free_bytes

    @property
    def host_need(self) -> int:
        """Host bytes of an offloaded run beside a CUDA card: the head, its inputs and llama.cpp's outputs."""
        return self.head if self.offloaded and not self.hardware.shares_host_memory else 0

    @property
    def fits(self) -> bool:
        return self.need <= self.available and (self.host_need == 0
                                                or self.host_need <= self.hardware.host_free_bytes)

    def to_json(self) -> dict[str, Any]:
        terms = {k: getattr(self, k) for k in ("context", "kv_dtype", "chunk", "weights", "kv_cache", "recurrent",
                                               "compute", "head", "overhead", "margin", "offloaded")}
        return {"format": "gguf", "backend": BACKEND, "device": self.hardware.device,
                "device_name": self.hardware.name, **terms, "need_bytes": self.need,
                "available_bytes": self.available, "fits": self.fits, "file_type": self.footprint.file_type,
                "tensor_types": self.footprint.type_counts}


def gguf_plan(footprint: GgufFootprint, hardware: Hardware, *, context: int, kv: str = "float16",
              offloaded: bool = False, chunk: int | None = None) -> GgufPlan:
    """The memory of ``footprint`` run by llama.cpp on ``hardware`` at ``context`` tokens with a ``kv`` cache."""
    if context < 1:
        raise ValueError(f"context must be positive, got {context}")
    if kv not in KV_BYTES:
        raise ValueError(f"the KV cache is float16 or float32, not {kv!r}")
    dims = footprint.dims
    n_ctx = -(-context // CTX_PAD) * CTX_PAD
    chunk = min(chunk or chunk_for(footprint.vocab), n_ctx)
    attention_layers = dims.layers - dims.linear_layers
    kv_cache = n_ctx * attention_layers * 2 * dims.kv_heads * dims.head_dim * KV_BYTES[kv]
    recurrent = linear_state_bytes(dims, 4)
    terms = dims.per_token(4)
    layer = max(terms["mlp"], terms["attention"], terms["linear"])
    # the chunk's mask over the context (F16 for flash attention, else F32) and, without flash attention (the F32
    # mode), its attention scores over the context; the logits in the graph and again in the output buffer
    mask = chunk * n_ctx * (2 if kv == "float16" else 4)
    scores = 0 if kv == "float16" else chunk * n_ctx * dims.heads * 4
    compute = chunk * (terms["carried"] + layer + 2 * 4 * footprint.vocab) + mask + scores
    # numpy's head: its weights, llama.cpp's states copied out [T, h] and the head's own per-token terms
    head = footprint.head + context * (4 * dims.hidden + terms["head"])
    weights = footprint.weights
    margin = int(MARGIN * (weights + kv_cache + compute + head))
    return GgufPlan(footprint=footprint, hardware=hardware, context=n_ctx, kv_dtype=kv, chunk=chunk,
                    weights=weights, kv_cache=kv_cache, recurrent=recurrent, compute=compute, head=head,
                    overhead=RUNTIME_OVERHEAD[hardware.kind], margin=margin, offloaded=offloaded)


def max_gguf_context(footprint: GgufFootprint, hardware: Hardware, *, kv: str, offloaded: bool,
                     limit: int) -> int:
    """The longest context (a multiple of :data:`CTX_PAD`, at most ``limit``) that fits; 0 when none does."""
    lo, hi = 0, limit // CTX_PAD
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if gguf_plan(footprint, hardware, context=mid * CTX_PAD, kv=kv, offloaded=offloaded).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo * CTX_PAD


def explain_gguf(p: GgufPlan) -> list[str]:
    """The terms with this plan's numbers, one per line."""
    g = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
    f, d = p.footprint, p.footprint.dims
    types = ", ".join(f"{k} {v}" for k, v in f.type_counts.items())
    return [
        f"weights (the GGUF's tensors as stored, {f.file_type or 'file type not recorded'}: {types}): layers "
        f"{g(sum(f.layers))} + token_embd {g(f.embed_tokens)} + output {g(f.lm_head)} + other {g(f.other)} = "
        f"{g(p.weights)}",
        f"KV cache ({p.kv_dtype}): {p.context:,} cells × {d.layers - d.linear_layers} attention layers × 2 × "
        f"{d.kv_heads}×{d.head_dim} = {g(p.kv_cache)}; recurrent state (F32, {d.linear_layers} linear layers, one "
        f"sequence) {g(p.recurrent)}",
        f"compute: one {p.chunk}-token decode chunk, its logits over a {f.vocab:,} vocabulary counted twice, its "
        "mask over the context" + (" and its attention scores over the context (F32 runs have no flash attention)"
                                   if p.kv_dtype == "float32" else "") + f": {g(p.compute)}",
        f"head (numpy, float32) over the context: {g(p.head)}" + (" in host memory" if p.host_need else ""),
        f"overhead {g(p.overhead)} + margin {g(p.margin)}; need {g(p.need)} of {g(p.available)} on "
        f"{p.hardware.device} ({p.hardware.name}) → {'fits' if p.fits else 'does not fit'}",
    ]


def render_gguf(p: GgufPlan, *, show_explain: bool) -> str:
    """``clef-local plan`` for a GGUF release: one line of terms and the verdict."""
    f = p.footprint
    lines = [f"{f.name} ({f.architecture} GGUF, {f.file_type or 'file type not recorded'}; {f.file_bytes / GiB:.2f} "
             f"GiB) on llama.cpp, {p.hardware.device}: {p.hardware.name}, {p.available / GiB:.1f} GiB available",
             f"context {p.context:,}, {p.kv_dtype} KV cache, decoded in {p.chunk}-token chunks", "",
             f"{'weights':>8}{'KV':>7}{'state':>7}{'compute':>9}{'head':>7}{'overhead':>10}{'need':>7}  verdict (GiB)",
             f"{p.weights / GiB:>8.2f}{p.kv_cache / GiB:>7.2f}{p.recurrent / GiB:>7.2f}{p.compute / GiB:>9.2f}"
             f"{p.head / GiB:>7.2f}{(p.overhead + p.margin) / GiB:>10.2f}{p.need / GiB:>7.2f}  "
             f"{'fits' if p.fits else 'does not fit'}"]
    if not p.fits:
        longest = max_gguf_context(f, p.hardware, kv=p.kv_dtype, offloaded=p.offloaded, limit=p.context)
        lines.append(f"a context of {longest:,} tokens fits (--context)" if longest else
                     "not even 256 tokens fit: a smaller --type of export-gguf, or a machine with more memory")
    if show_explain:
        lines += ["", *explain_gguf(p)]
    return "\n".join(lines)


def gpu_offload() -> bool:
    """Whether this llama-cpp-python build offloads to a GPU (imports the binding)."""
    from clef_local.planning.llamacpp_build import llama_cpp_build

    return bool(llama_cpp_build()["gpu_offload"])


def plan_gguf_load(release: Release, options: LoadOptions, hardware: Hardware, *,
                   installed: dict[str, str | None]) -> LoadDecision:
    """The loader's decision for a GGUF release, or for ``backend="llamacpp"`` on a release with a ``gguf/``:
    llama.cpp on ``hardware`` (a GPU when this build offloads to one, else the CPU), checked against
    :func:`gguf_plan` at ``options.max_length`` (None: the model's default context; when that does not fit, 16,384
    tokens, as for the other backends)."""
    from clef_local.runtime.encoding import REFERENCE_MAX_LENGTH, default_max_length

    backend = options.backend
    if backend not in ("auto", BACKEND):
        from clef_local.formats.gguf_release import source_hint

        raise ApiUsageError(f"{release.path} is a GGUF release (gguf/model.gguf, no safetensors backbone): only "
                            f"--backend {BACKEND} runs it, not {backend}; load {source_hint(release)} for {backend}")
    if installed.get(BACKEND) is not None:
        raise ApiUsageError(f"{release.path} holds a GGUF backbone, which runs on llama.cpp: {installed[BACKEND]}")
    footprint = gguf_footprint(release)
    kv = kv_dtype(options.dtype)
    gpu = hardware.kind in ("cuda", "apple")
    offloaded = gpu and gpu_offload()
    device = hardware.device if offloaded else "cpu"
    where = hardware if offloaded or hardware.kind == "cpu" else as_cpu(hardware)
    reason = (f"{'asked for' if backend == BACKEND else 'a GGUF release runs on llama.cpp'}; "
              + (f"layers offloaded to {device}" if offloaded else
                 "on the CPU" + (" (this llama-cpp-python has no GPU build: see `clef-local doctor`)" if gpu else ""))
              + f"; {kv} KV cache" + (" (asked for: exact)" if kv == "float32" else ""))
    decision = LoadDecision(backend=BACKEND, device=device, dtype=kv, scheme=footprint.file_type or "gguf",
                            kernel=KERNEL, reason=reason)
    context = options.max_length or default_max_length(release.max_position_embeddings)
    if not options.check_memory:
        return replace(decision, context=context)
    # prefill_chunk: the tokens of each decode (0: the whole request in one), else chunk_for's
    def chunk(tokens: int) -> int | None:
        return tokens if options.prefill_chunk == 0 else options.prefill_chunk

    p = gguf_plan(footprint, where, context=context, kv=kv, offloaded=offloaded, chunk=chunk(context))
    if not p.fits and options.max_length is None and context > REFERENCE_MAX_LENGTH:
        shorter = gguf_plan(footprint, where, context=REFERENCE_MAX_LENGTH, kv=kv, offloaded=offloaded,
                            chunk=chunk(REFERENCE_MAX_LENGTH))
        if shorter.fits:
            log.warning(
                "the GGUF on llama.cpp needs %.1f GiB at %s tokens, %.1f GiB free: planned at %s tokens instead "
                "(max_length= asks for a context and refuses the load when it does not fit)",
                p.need / GiB, f"{context:,}", p.available / GiB, f"{REFERENCE_MAX_LENGTH:,}")
            p, context = shorter, REFERENCE_MAX_LENGTH
    if not p.fits:
        longest = max_gguf_context(footprint, where, kv=kv, offloaded=offloaded, limit=context)
        raise InsufficientMemoryError(
            f"{footprint.name} ({footprint.file_type or 'GGUF'}) on llama.cpp needs {p.need / GiB:.1f} GiB at "
            f"{context:,} tokens, {p.available / GiB:.1f} GiB free on {where.device} ({where.name}); try "
            + (f"max_length={longest} (a context of {longest:,} tokens fits), or " if longest else "")
            + "a smaller --type of clef-local export-gguf (clef-local plan --model DIR --explain shows the terms)")
    return replace(decision, need_bytes=p.need, available_bytes=p.available, context=context)
