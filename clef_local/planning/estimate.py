"""Memory a decision pass needs on a device: weights + one prefill's activations + overhead, and a state cache's
entries. Pure functions; the formulas, term by term: docs/hardware.md#the-memory-formula.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from clef_local.planning.census import FORMATS, WeightCensus
from clef_local.planning.hardware import Hardware
from clef_local.units import GiB

STATE_CACHE_SHARE = 0.25  # of the memory a plan leaves free, for a state cache of unspecified size
STATE_CACHE_CAP = 4 * GiB
DTYPE_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
RUNTIME_OVERHEAD = {"cuda": GiB // 2, "apple": GiB // 2, "cpu": GiB // 2}
MARGIN = 0.05
CHUNK = 64  # the gated delta rule's chunk length in transformers' PyTorch fallback
# Chunked prefill (docs/hardware.md#chunked-prefill): chunk lengths are multiples of this, so that every chunk boundary
# is also one of the gated delta rule's own 64-token chunks (the same arithmetic as one pass, block for block)
PREFILL_STEP = 256
# the longest chunk the planner picks: past a few thousand tokens a longer chunk runs no faster (the matmuls are
# already large), while the memory it takes is what a state cache could have had
PREFILL_MAX_CHUNK = 8192


@dataclass(frozen=True)
class ModelDims:
    """The shapes the activation formula needs, from a backbone config (and the head's width)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    attn_output_gate: bool = False
    linear_layers: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv_kernel: int = 0
    head_width: int = 0
    max_context: int | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any], head_width: int = 0) -> ModelDims:
        """Dims of a ``config.json`` (a multimodal config's ``text_config``)."""
        text = config.get("text_config") or config
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        layer_types = text.get("layer_types") or []
        return cls(hidden=hidden, intermediate=int(text["intermediate_size"]), layers=int(text["num_hidden_layers"]),
                   heads=heads, kv_heads=int(text.get("num_key_value_heads") or heads),
                   head_dim=int(text.get("head_dim") or hidden // heads),
                   attn_output_gate=bool(text.get("attn_output_gate", False)),
                   linear_layers=sum(t == "linear_attention" for t in layer_types),
                   linear_k_heads=int(text.get("linear_num_key_heads") or 0),
                   linear_v_heads=int(text.get("linear_num_value_heads") or 0),
                   linear_k_dim=int(text.get("linear_key_head_dim") or 0),
                   linear_v_dim=int(text.get("linear_value_head_dim") or 0),
                   linear_conv_kernel=int(text.get("linear_conv_kernel_dim") or 0), head_width=head_width,
                   max_context=int(text["max_position_embeddings"]) if text.get("max_position_embeddings") else None)

    def per_token(self, d: int) -> dict[str, int]:
        """Bytes per token of each term of the activation formula (docs/hardware.md), for a ``d``-byte dtype."""
        h = self.hidden
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        terms = {
            "carried": 4 * h * d,
            "mlp": 3 * self.intermediate * d,
            "attention": d * (q * (2 if self.attn_output_gate else 1) + 3 * kv + 3 * q
                              + (2 * q if self.kv_heads < self.heads else 0)),
            "linear": 0,
            "head": h * d + 4 * (h * (d != 4) + h + 4 * self.head_width),
            "rope": 2 * self.head_dim * d,
        }
        if self.linear_layers:
            k_width = self.linear_k_heads * self.linear_k_dim
            v_width = self.linear_v_heads * self.linear_v_dim
            v_wide = self.linear_v_heads * max(self.linear_k_dim, self.linear_v_dim)
            terms["linear"] = d * (2 * (2 * k_width + v_width) + v_width) + 4 * (
                10 * v_wide + 3 * self.linear_v_heads * CHUNK)
        return terms


def state_entry_bytes(dims: ModelDims, tokens: int, dtype: str) -> int:
    """Exact bytes of one cached state of ``tokens`` positions (docs/hardware.md) in compute ``dtype``:
    what :class:`clef_local.backends.torch_cache.TorchState` holds."""
    d = DTYPE_SIZE[dtype]
    attention_layers = dims.layers - dims.linear_layers
    per_token = d * (dims.hidden + attention_layers * 2 * dims.kv_heads * dims.head_dim)
    fixed = 0
    if dims.linear_layers:
        conv_width = 2 * dims.linear_k_heads * dims.linear_k_dim + dims.linear_v_heads * dims.linear_v_dim
        recurrent = dims.linear_v_heads * dims.linear_k_dim * dims.linear_v_dim
        fixed = dims.linear_layers * (d * conv_width * dims.linear_conv_kernel + 4 * recurrent)
    return tokens * per_token + fixed


@dataclass(frozen=True)
class Activations:
    """A prefill's activation bytes and its terms; ``chunk``: the chunk length of a chunked prefill (None: one
    pass), whose ``kept`` bytes (the output states, every attention layer's keys and values) live across chunks."""

    total: int
    per_token: int
    tokens: int
    mask: int
    rope: int
    terms: dict[str, int]
    dominant: str
    chunk: int | None = None
    kept: int = 0


def activations(dims: ModelDims, context: int, batch: int, dtype: str) -> Activations:
    """Peak activation bytes of one prefill of ``batch`` records of ``context`` tokens (docs/hardware.md)."""
    d = DTYPE_SIZE[dtype]
    terms = dims.per_token(d)
    layer = max(("mlp", "attention", "linear"), key=lambda k: terms[k])
    backbone = terms["carried"] + terms[layer]
    per_token = max(backbone, terms["head"])
    tokens = context * batch
    mask = batch * context * context if batch > 1 else 0
    rope = tokens * terms["rope"]
    return Activations(total=tokens * per_token + mask + rope, per_token=per_token, tokens=tokens, mask=mask,
                       rope=rope, terms=terms, dominant=layer if backbone >= terms["head"] else "head")


def chunked_activations(dims: ModelDims, context: int, batch: int, dtype: str, chunk: int) -> Activations:
    """Peak activation bytes of one prefill of ``batch`` records of ``context`` tokens run in chunks of ``chunk``
    tokens, each chunk over the keys, values and linear states of the ones before it (docs/hardware.md#chunked-prefill).

    Across the pass live the output states and every full-attention layer's keys and values (``kept``, per token of
    the context); within a chunk, the one-pass terms of its tokens. An attention layer also holds, over the whole
    context, its keys and values grown by the chunk beside the old ones, SDPA's repeated heads (grouped heads: the
    padding mask keeps SDPA off its grouped path) and the boolean mask of the chunk over the context with the
    additive copy SDPA makes of it in the query dtype. The head reads every position after the backbone's cache is
    freed.
    """
    d = DTYPE_SIZE[dtype]
    terms = dims.per_token(d)
    chunk = max(1, min(chunk, context))
    tokens, local = context * batch, chunk * batch
    q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    kept = d * (dims.hidden + (dims.layers - dims.linear_layers) * 2 * kv)
    grown = d * (2 * kv + (2 * q if dims.kv_heads < dims.heads else 0))
    # the boolean mask of the chunk's queries over the context, and the additive copy SDPA makes of it in the
    # query dtype (measured on CPU: not per head); a one-piece pass of one record runs causal, without a mask
    mask = batch * chunk * context * (1 + d) if context > chunk or batch > 1 else 0
    attention = local * (terms["carried"] + terms["attention"]) + tokens * grown + mask
    layer = max(("mlp", "linear"), key=lambda k: terms[k])
    other = local * (terms["carried"] + terms[layer])
    states = batch * linear_state_bytes(dims, d)
    rope = local * terms["rope"]
    backbone = tokens * kept + states + max(attention, other) + rope
    head = tokens * terms["head"]
    dominant = "head" if head > backbone else "attention" if attention >= other else layer
    return Activations(total=max(backbone, head), per_token=kept, tokens=tokens, mask=mask, rope=rope, terms=terms,
                       dominant=dominant, chunk=chunk, kept=tokens * kept)


def linear_state_bytes(dims: ModelDims, d: int) -> int:
    """One record's conv and recurrent (float32) states over every linear-attention layer."""
    if not dims.linear_layers:
        return 0
    conv_width = 2 * dims.linear_k_heads * dims.linear_k_dim + dims.linear_v_heads * dims.linear_v_dim
    recurrent = dims.linear_v_heads * dims.linear_k_dim * dims.linear_v_dim
    return dims.linear_layers * (d * conv_width * dims.linear_conv_kernel + 4 * recurrent)


def fit_chunk(dims: ModelDims, context: int, batch: int, dtype: str, room: int) -> int | None:
    """How to run a prefill of ``batch`` × ``context`` tokens in ``room`` bytes of activations: None when the
    one pass fits (no chunking), else the longest chunk (a multiple of :data:`PREFILL_STEP`, shorter than the
    context, at most :data:`PREFILL_MAX_CHUNK`) whose chunked pass fits, 0 when not even :data:`PREFILL_STEP`
    tokens do."""
    if activations(dims, context, batch, dtype).total <= room:
        return None
    lo, hi = 0, min(context - 1, PREFILL_MAX_CHUNK) // PREFILL_STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chunked_activations(dims, context, batch, dtype, mid * PREFILL_STEP).total <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo * PREFILL_STEP


def activation_room(available: int, device_weights: int, overhead: int, state_cache: int = 0) -> int:
    """The most activation bytes with which ``device_weights`` + activations + ``overhead`` + the margin + a
    ``state_cache`` still fit in ``available`` (0 when nothing is left)."""
    return max(0, int((available - overhead - state_cache) / (1 + MARGIN)) - device_weights)


@dataclass(frozen=True)
class Plan:
    """One format's memory on one device: the weights split by residency, activations, overhead, verdict."""

    fmt: str
    census: WeightCensus
    hardware: Hardware
    context: int
    batch: int
    dtype: str
    host_embeddings: bool
    media: bool
    device_weights: int
    host_weights: int
    activations: Activations
    overhead: int
    margin: int
    visual_tokens: int = 0  # of the context, filled by images (clef_local.planning.vision)
    vision_activations: int = 0  # the vision tower's peak, freed before the text layers run
    state_cache: int = 0  # a state cache's budget + one entry at the context (0: no cache)

    @property
    def chunk(self) -> int | None:
        """The chunk length of the prefill this plan counts (None: one pass)."""
        return self.activations.chunk

    @property
    def activation_room(self) -> int:
        """Activation bytes that still fit beside this plan's weights, overhead, margin and state cache."""
        return activation_room(self.available, self.device_weights, self.overhead, self.state_cache)

    @property
    def need(self) -> int:
        """Bytes needed on the device (on CPU and Apple: in the one memory pool): the larger of the two passes'
        activations (the vision tower runs, and frees its temporaries, before the text prefill), and the state
        cache."""
        return (self.device_weights + max(self.activations.total, self.vision_activations) + self.overhead
                + self.margin + self.state_cache)

    @property
    def available(self) -> int:
        return self.hardware.free_bytes

    @property
    def host_fits(self) -> bool:
        return self.hardware.shares_host_memory or self.host_weights <= self.hardware.host_free_bytes

    @property
    def fits(self) -> bool:
        return self.need <= self.available and self.host_fits

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.fmt, "device": self.hardware.device, "device_name": self.hardware.name,
            "context": self.context, "batch": self.batch, "dtype": self.dtype,
            "weights_source": self.census.source, "weights_exact": self.census.exact,
            "backbone_bytes": self.census.backbone, "head_bytes": self.census.head,
            "device_weight_bytes": self.device_weights, "host_weight_bytes": self.host_weights,
            "activation_bytes": self.activations.total, "activation_terms_per_token": self.activations.terms,
            "prefill_chunk": self.chunk, "activation_room_bytes": self.activation_room,
            "overhead_bytes": self.overhead, "margin_bytes": self.margin, "state_cache_bytes": self.state_cache,
            "need_bytes": self.need,
            "visual_tokens": self.visual_tokens, "vision_activation_bytes": self.vision_activations,
            "available_bytes": self.available, "fits": self.fits,
        }


def plan(census: WeightCensus, dims: ModelDims, hardware: Hardware, *, context: int, batch: int = 1,
         dtype: str = "bfloat16", host_embeddings: bool = True, media: bool = False, visual_tokens: int = 0,
         vision_activations: int = 0, state_cache: int = 0, chunking: bool = False,
         chunk: int | None = None) -> Plan:
    """The memory plan of ``census`` on ``hardware``.

    ``host_embeddings``: ``embed_tokens`` and ``lm_head`` stay in host memory (only gathered, docs/hardware.md); it
    matters only on a CUDA card. ``media``: the vision tower is resident (else it is not loaded at all, or stays on the
    host). ``visual_tokens`` (of the context) and ``vision_activations`` (bytes) come from
    :mod:`clef_local.planning.vision` for requests with images. ``state_cache``: a state cache's budget in bytes; the
    plan adds it and one entry at ``context``. ``chunking``: the backend can run the prefill in chunks
    (:func:`chunked_activations`); when the one pass does not fit, the plan counts the longest chunk that does
    (:func:`fit_chunk`); when none does, chunks of :data:`PREFILL_MAX_CHUNK` (or the one pass, when that is less):
    what a device just large enough would run. ``chunk``: count chunks of that many tokens instead (a chunk length
    asked for, ``load(prefill_chunk=…)``).
    """
    if state_cache < 0:
        raise ValueError(f"state_cache is a budget in bytes, got {state_cache}")
    if context < 1 or batch < 1:
        raise ValueError(f"context and batch must be positive, got context={context}, batch={batch}")
    if dtype not in DTYPE_SIZE:
        raise ValueError(f"unknown compute dtype {dtype!r}; use one of {', '.join(DTYPE_SIZE)}")
    held = held_weights(census, dtype)
    if hardware.shares_host_memory:
        device_weights = held.device_weights(host_embeddings=False, media=media)
        host_weights = 0
    else:
        device_weights = held.device_weights(host_embeddings=host_embeddings, media=media)
        host_weights = held.host_weights(host_embeddings=host_embeddings, media=media)
    overhead = RUNTIME_OVERHEAD[hardware.kind]
    cache = state_cache + state_entry_bytes(dims, context, dtype) if state_cache else 0
    acts = activations(dims, context, batch, dtype)
    if chunk is not None:
        if chunk < context:
            acts = chunked_activations(dims, context, batch, dtype, chunk)
    elif chunking:
        room = activation_room(hardware.free_bytes, device_weights, overhead, cache)
        chunk = fit_chunk(dims, context, batch, dtype, room)
        if chunk:
            acts = chunked_activations(dims, context, batch, dtype, chunk)
        elif chunk == 0:  # nothing fits here: what a device just large enough would run, in full-length chunks
            longest = chunked_activations(dims, context, batch, dtype, PREFILL_MAX_CHUNK)
            acts = longest if longest.total < acts.total and context > PREFILL_MAX_CHUNK else acts
    margin = int(MARGIN * (device_weights + max(acts.total, vision_activations)))
    return Plan(fmt=census.fmt, census=census, hardware=hardware, context=context, batch=batch, dtype=dtype,
                host_embeddings=host_embeddings, media=media, device_weights=device_weights,
                host_weights=host_weights, activations=acts, overhead=overhead, margin=margin,
                visual_tokens=visual_tokens, vision_activations=vision_activations, state_cache=cache)


def held_weights(census: WeightCensus, dtype: str) -> WeightCensus:
    """``census`` as a backend holds it computing in ``dtype``: a release's floating tensors (stored in BF16) are
    cast to the compute dtype at load, so float32 doubles them; a variant's packed linears stay as stored and its
    head is float32 either way."""
    scale = DTYPE_SIZE[dtype] / 2
    if scale == 1:
        return census
    def held(stored: int) -> int:
        return int(stored * scale)

    return replace(census, text_other=held(census.text_other), embed_tokens=held(census.embed_tokens),
                   lm_head=held(census.lm_head), vision=held(census.vision),
                   quantized_linears=held(census.quantized_linears) if census.fmt == "bf16"
                   else census.quantized_linears)


def auto_state_cache(p: Plan, dims: ModelDims) -> int:
    """The state cache budget when none is asked for: a quarter of what ``p`` (planned without a cache) leaves free
    after one entry at its context, at most :data:`STATE_CACHE_CAP`; 0 when nothing is left."""
    spare = p.available - p.need - state_entry_bytes(dims, p.context, p.dtype)
    return int(min(STATE_CACHE_CAP, max(0, spare) * STATE_CACHE_SHARE))


def best_fit(plans: Mapping[str, Plan]) -> Plan | None:
    """The best-precision format that fits (order of :data:`FORMATS`, then any other: a mixed variant's), or None."""
    for fmt in (*FORMATS, *(f for f in plans if f not in FORMATS)):
        if fmt in plans and plans[fmt].fits:
            return plans[fmt]
    return None


def max_context(census: WeightCensus, dims: ModelDims, hardware: Hardware, *, batch: int = 1,
                dtype: str = "bfloat16", host_embeddings: bool = True, media: bool = False,
                limit: int = 1 << 20, chunking: bool = False) -> int:
    """The longest context (tokens, a multiple of 256) that fits, 0 when not even 256 tokens do."""
    def fits(context: int) -> bool:
        return plan(census, dims, hardware, context=context, batch=batch, dtype=dtype,
                    host_embeddings=host_embeddings, media=media, chunking=chunking).fits

    lo, hi = 0, limit // 256
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * 256):
            lo = mid
        else:
            hi = mid - 1
    return lo * 256


def explain(p: Plan) -> list[str]:
    """The formula with this plan's numbers, one line per term."""
    g = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
    c, a = p.census, p.activations
    t = a.terms
    lines = [
        f"weights ({c.source}{', exact' if c.exact else ''}): text linears {g(c.quantized_linears)} + rest of the "
        f"text model {g(c.text_other)} + embed_tokens {g(c.embed_tokens)} + lm_head {g(c.lm_head)} + vision "
        f"{g(c.vision)} = backbone {g(c.backbone)}; joint head (float32) {g(c.head)}",
    ]
    if DTYPE_SIZE[p.dtype] != 2:
        lines.append(f"  computing in {p.dtype}: the {'weights' if c.fmt == 'bf16' else 'unquantized tensors'} are "
                     f"held at {DTYPE_SIZE[p.dtype]} bytes per value (stored in BF16)")
    if p.hardware.shares_host_memory:
        lines.append(f"  one memory pool ({p.hardware.kind}): every weight counts"
                     + ("" if p.media else ", the vision tower is not loaded without media")
                     + f": {g(p.device_weights)}")
    else:
        lines.append(f"  on the device: text model + head{' + embeddings' if not p.host_embeddings else ''}"
                     f"{' + vision' if p.media else ''} = {g(p.device_weights)}; in host memory: {g(p.host_weights)}"
                     + (" (embed_tokens, lm_head: only gathered)" if p.host_embeddings else ""))
    d = DTYPE_SIZE[p.dtype]
    lines += [
        f"activations ({p.dtype}, d={d}) for N = {p.context:,} × {p.batch} = {a.tokens:,} tokens, per token: "
        f"carried 4h·d = {t['carried']:,} B + max(mlp 3I·d = {t['mlp']:,} B, attention {t['attention']:,} B, "
        f"linear attention {t['linear']:,} B) [{a.dominant}]; head {t['head']:,} B",
        *([f"  N × {a.per_token:,} B + mask {g(a.mask)} + rope {g(a.rope)} = {g(a.total)}"] if a.chunk is None else [
            f"  the one pass does not fit: chunked prefill in {a.chunk:,}-token chunks "
            "(docs/hardware.md#chunked-prefill): kept across chunks N × "
            f"{a.per_token:,} B (output states, keys and values) = {g(a.kept)}, the chunk's own terms, the chunk's "
            f"mask over the context {g(a.mask)}; the larger of that and the head over N [{a.dominant}] = "
            f"{g(a.total)}"]),
        *([f"  images: {p.visual_tokens:,} visual tokens of the context; the vision tower's pass before it "
           f"{g(p.vision_activations)} (clef_local/planning/vision.py); the larger of the two counts"]
          if p.vision_activations else []),
        f"overhead {g(p.overhead)} (runtime) + margin 5% of weights and activations {g(p.margin)}",
        *([f"state cache {g(p.state_cache)} (its budget + one entry at {p.context:,} tokens)"] if p.state_cache
          else []),
        f"need {g(p.device_weights)} + {g(max(a.total, p.vision_activations))} + {g(p.overhead)} + {g(p.margin)}"
        f"{f' + {g(p.state_cache)}' if p.state_cache else ''} = {g(p.need)}; available "
        f"{g(p.available)} on {p.hardware.device} ({p.hardware.name}) → {'fits' if p.fits else 'does not fit'}",
    ]
    if not p.host_fits:
        lines.append(f"  host memory: {g(p.host_weights)} needed, {g(p.hardware.host_free_bytes)} free → too little")
    return lines
