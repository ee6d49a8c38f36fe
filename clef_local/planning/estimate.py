"""Memory a decision pass needs on a device: weights + one prefill's activations + overhead, and a state cache's
entries. Pure functions; the formulas, term by term: docs/hardware.md#the-memory-formula.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
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
    """A prefill's activation bytes and its terms."""

    total: int
    per_token: int
    tokens: int
    mask: int
    rope: int
    terms: dict[str, int]
    dominant: str


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
            "overhead_bytes": self.overhead, "margin_bytes": self.margin, "state_cache_bytes": self.state_cache,
            "need_bytes": self.need,
            "visual_tokens": self.visual_tokens, "vision_activation_bytes": self.vision_activations,
            "available_bytes": self.available, "fits": self.fits,
        }


def plan(census: WeightCensus, dims: ModelDims, hardware: Hardware, *, context: int, batch: int = 1,
         dtype: str = "bfloat16", host_embeddings: bool = True, media: bool = False, visual_tokens: int = 0,
         vision_activations: int = 0, state_cache: int = 0) -> Plan:
    """The memory plan of ``census`` on ``hardware``.

    ``host_embeddings``: ``embed_tokens`` and ``lm_head`` stay in host memory (only gathered, docs/hardware.md); it
    matters only on a CUDA card. ``media``: the vision tower is resident (else it is not loaded at all, or stays on the
    host). ``visual_tokens`` (of the context) and ``vision_activations`` (bytes) come from
    :mod:`clef_local.planning.vision` for requests with images. ``state_cache``: a state cache's budget in bytes; the
    plan adds it and one entry at ``context``.
    """
    if state_cache < 0:
        raise ValueError(f"state_cache is a budget in bytes, got {state_cache}")
    if context < 1 or batch < 1:
        raise ValueError(f"context and batch must be positive, got context={context}, batch={batch}")
    if dtype not in DTYPE_SIZE:
        raise ValueError(f"unknown compute dtype {dtype!r}; use one of {', '.join(DTYPE_SIZE)}")
    if hardware.shares_host_memory:
        device_weights = census.device_weights(host_embeddings=False, media=media)
        host_weights = 0
    else:
        device_weights = census.device_weights(host_embeddings=host_embeddings, media=media)
        host_weights = census.host_weights(host_embeddings=host_embeddings, media=media)
    acts = activations(dims, context, batch, dtype)
    overhead = RUNTIME_OVERHEAD[hardware.kind]
    margin = int(MARGIN * (device_weights + max(acts.total, vision_activations)))
    cache = state_cache + state_entry_bytes(dims, context, dtype) if state_cache else 0
    return Plan(fmt=census.fmt, census=census, hardware=hardware, context=context, batch=batch, dtype=dtype,
                host_embeddings=host_embeddings, media=media, device_weights=device_weights,
                host_weights=host_weights, activations=acts, overhead=overhead, margin=margin,
                visual_tokens=visual_tokens, vision_activations=vision_activations, state_cache=cache)


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
                limit: int = 1 << 20) -> int:
    """The longest context (tokens, a multiple of 256) that fits, 0 when not even 256 tokens do."""
    def fits(context: int) -> bool:
        return plan(census, dims, hardware, context=context, batch=batch, dtype=dtype,
                    host_embeddings=host_embeddings, media=media).fits

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
        f"  N × {a.per_token:,} B + mask {g(a.mask)} + rope {g(a.rope)} = {g(a.total)}",
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
