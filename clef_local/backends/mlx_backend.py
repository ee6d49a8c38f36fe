"""The MLX backend: the backbone through ``mlx-lm``'s ``llama`` and ``qwen3_5`` models up to the final norm, the
joint schema head in MLX float32 (:mod:`clef_local.heads.mlx_head`). Imports neither torch nor transformers.

RoPE theta is read from the config, passed explicitly and checked on every RoPE module (:func:`check_rope`), since
mlx-lm would silently fall back to 10000; that trap, the dtypes and the quantized layers: docs/hardware.md#mlx.
"""

from __future__ import annotations

import copy
import importlib
import logging
import platform
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from clef_local.backends.mlx_weights import QuantizedLayer, Stored, load_backbone_tensors, variant_scheme
from clef_local.errors import ReleaseError
from clef_local.formats.quant_plan import MIXED, mixed_plan
from clef_local.formats.release import Release
from clef_local.heads.mlx_head import load_head
from clef_local.quant import registry
from clef_local.runtime.layout import HeadLayout, pad_batch
from clef_local.runtime.state_cache import model_identity

if TYPE_CHECKING:
    from clef_local.planning.choice import LoadDecision
    from clef_local.planning.prefill import PrefillBudget
    from clef_local.runtime.encoding import EncodedRecord
    from clef_local.runtime.state_cache import StateCache

log = logging.getLogger(__name__)

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
ARCHITECTURES = {"llama": "mlx_lm.models.llama", "qwen3_5": "mlx_lm.models.qwen3_5"}
_KEEP_FLOAT32 = ("A_log",)  # mlx-lm's cast_predicate keeps the gated-delta decay in float32
_PLAIN_ROPE = ("default", "linear", "mrope")  # the rope types mlx-lm builds as nn.RoPE (mrope: text-only positions)


def _rope_params(text_config: Mapping[str, Any]) -> dict[str, Any]:
    params = text_config.get("rope_parameters") or text_config.get("rope_scaling") or {}
    return dict(params) if isinstance(params, Mapping) else {}


def source_rope(text_config: Mapping[str, Any]) -> tuple[float, str, float]:
    """(theta, rope type, partial rotary factor) as the source config states them: ``rope_parameters`` (transformers
    5) and/or the top-level ``rope_theta``; they must agree and one must be present."""
    params = _rope_params(text_config)
    values = {"rope_parameters.rope_theta": params.get("rope_theta"), "rope_theta": text_config.get("rope_theta")}
    given = {k: float(v) for k, v in values.items() if v is not None}
    if not given:
        raise ReleaseError("config.json states no rope_theta (neither top-level nor in rope_parameters); add the "
                           "backbone's value (transformers' default for llama is 10000.0)")
    if len(set(given.values())) > 1:
        raise ReleaseError(f"config.json: rope_theta values disagree ({given}); fix the config")
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    factor = float(params.get("partial_rotary_factor", text_config.get("partial_rotary_factor", 1.0)))
    return next(iter(given.values())), rope_type, factor


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(dict(config.get("text_config") or config))


def model_type(config: Mapping[str, Any]) -> str:
    """The mlx-lm architecture of a release config (``llama`` or ``qwen3_5``), or a ReleaseError naming them."""
    kind = str(config.get("model_type") or "")
    if kind not in ARCHITECTURES:
        raise ReleaseError(f"the MLX backend runs {', '.join(ARCHITECTURES)} backbones, not model_type {kind!r}; "
                           f"use backend='torch'")
    return kind


def mlx_lm_rope_theta(config: Mapping[str, Any]) -> float:
    """The rope theta mlx-lm itself reads from this raw ``config.json`` (what a plain mlx-lm conversion uses)."""
    kind = model_type(config)
    module = importlib.import_module(ARCHITECTURES[kind])
    if kind == "qwen3_5":
        return float(module.TextModelArgs.from_dict(_text_config(config)).rope_theta)
    return float(module.ModelArgs.from_dict(copy.deepcopy(dict(config))).rope_theta)


def model_args(config: Mapping[str, Any]) -> tuple[str, Any]:
    """(model type, mlx-lm ``ModelArgs``) with the source RoPE passed explicitly."""
    kind = model_type(config)
    module = importlib.import_module(ARCHITECTURES[kind])
    text = _text_config(config)
    theta, rope_type, _ = source_rope(text)
    if rope_type not in _PLAIN_ROPE:
        raise ReleaseError(f"rope_type {rope_type!r}: the MLX backend checks only plain RoPE ({_PLAIN_ROPE}); "
                           f"use backend='torch'")
    read = mlx_lm_rope_theta(config)
    if read != theta:
        log.warning("mlx-lm would read rope_theta %s from %s's config.json (it has rope_parameters only); passing the "
                    "source's %s explicitly", read, kind, theta)
    if kind == "qwen3_5":
        layer_types = text.get("layer_types")
        interval = int(text.get("full_attention_interval", 4))
        derived = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                   for i in range(int(text["num_hidden_layers"]))]
        if layer_types is not None and list(layer_types) != derived:
            raise ReleaseError(f"qwen3_5 layer_types {layer_types} are not every {interval}th layer full attention "
                               "(what mlx-lm builds); use backend='torch'")
        text.setdefault("rope_parameters", {})["rope_theta"] = theta
        text["rope_theta"] = theta
        return kind, module.ModelArgs(model_type=kind, text_config=text)
    text["rope_theta"] = theta
    # mlx-lm's llama builds plain RoPE from rope_scaling=None; a "linear" type needs its factor passed on.
    text["rope_scaling"] = _rope_params(text) if rope_type == "linear" else None
    return kind, module.ModelArgs.from_dict(text)


def check_rope(model: nn.Module, text_config: Mapping[str, Any], head_dim: int) -> float:
    """Every RoPE module of ``model`` uses the source config's theta and rotary size; returns the theta."""
    theta, _, factor = source_rope(text_config)
    dims = int(head_dim * factor)
    found = [(name, m) for name, m in model.named_modules() if name.endswith("rope")]
    if not found:
        raise ReleaseError("the MLX backbone has no RoPE module to check")
    for name, module in found:
        base, got_dims = getattr(module, "base", None), getattr(module, "dims", None)
        if base is None or float(base) != theta or got_dims != dims:
            raise ReleaseError(f"MLX RoPE {name}: theta {base and float(base)}, {got_dims} rotary dims, but "
                               f"config.json says theta {theta}, {dims} dims; the converted model would be "
                               "silently wrong")
    return theta


QUANTIZED_MATMUL = "mlx_quantized_matmul"
DEQUANTIZE_MATMUL = "mlx_dequantize_matmul"


class ExactQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` on given MLX-layout arrays (no random init, no re-quantization); with ``row_scale``
    the output is multiplied by it per output feature (the int8 mapping of :mod:`mlx_weights`).

    ``kernel``: :data:`QUANTIZED_MATMUL` (``mx.quantized_matmul``, Metal's fast path) or :data:`DEQUANTIZE_MATMUL`
    (``x @ mx.dequantize(...).T`` per call, the same weights: on MLX's Linux CPU build much faster than its
    ``quantized_matmul``, docs/benchmarks.md#backends).
    """

    def __init__(self, arrays: Mapping[str, mx.array], group_size: int, bits: int,
                 kernel: str = QUANTIZED_MATMUL) -> None:
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = group_size, bits, "affine"
        if kernel not in (QUANTIZED_MATMUL, DEQUANTIZE_MATMUL):
            raise ValueError(f"kernel {kernel!r}: use {QUANTIZED_MATMUL!r} or {DEQUANTIZE_MATMUL!r}")
        self.kernel = kernel
        for key in ("weight", "scales", "biases", "row_scale", "bias"):
            if key in arrays:
                setattr(self, key, arrays[key])
        self.freeze()

    def dequantized(self) -> mx.array:
        """``scales · q + biases`` per group as MLX computes it ([out, in], the scales' dtype), without row_scale."""
        return mx.dequantize(self["weight"], self["scales"], self["biases"], group_size=self.group_size,
                             bits=self.bits, mode=self.mode)

    def __call__(self, x: mx.array) -> mx.array:
        if self.kernel == QUANTIZED_MATMUL:
            y = mx.quantized_matmul(x, self["weight"], scales=self["scales"], biases=self["biases"], transpose=True,
                                    group_size=self.group_size, bits=self.bits, mode=self.mode)
        else:
            y = x @ self.dequantized().T
        if "row_scale" in self:
            y = y * self["row_scale"]
        if "bias" in self:
            y = y + self["bias"]
        return y


def default_kernel(device: mx.Device) -> str:
    """The quantized-linear kernel for ``device``: quantized_matmul on Metal, dequantize + matmul on the CPU."""
    return QUANTIZED_MATMUL if device == mx.gpu else DEQUANTIZE_MATMUL


def resolve_dtype(name: str | None, release: Release) -> mx.Dtype:
    """``None``/``"auto"``: float32 without Metal (Linux CPU), else the release's stored dtype."""
    if name in (None, "auto"):
        name = release.dtype if mx.metal.is_available() else "float32"
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} for the MLX backend; use one of {', '.join(DTYPES)} or 'auto'")
    return DTYPES[name]


def resolve_device(device: str) -> mx.Device:
    """``auto``: the Metal GPU when there is one, else the CPU; ``cpu``; ``gpu``, ``mps``, ``metal`` or ``apple``
    (Metal only)."""
    if device in ("auto", ""):
        return mx.gpu if mx.metal.is_available() else mx.cpu
    if device == "cpu":
        return mx.cpu
    if device in ("gpu", "mps", "metal", "apple"):
        if not mx.metal.is_available():
            raise ValueError(f"device {device!r}: this MLX build has no Metal GPU; use device='cpu'")
        return mx.gpu
    raise ValueError(f"device {device!r} is not an MLX device; use 'auto', 'cpu' or 'gpu'")


class MLXBackbone:
    """A release's backbone as an mlx-lm model: final normed hidden states and output-embedding rows."""

    def __init__(self, release: Release, dtype: mx.Dtype, kernel: str = QUANTIZED_MATMUL) -> None:
        self.kernel = kernel
        self.kind, args = model_args(release.config)
        module = importlib.import_module(ARCHITECTURES[self.kind])
        self.model = module.Model(args)
        self.model.eval()
        self.dtype = dtype
        self.scheme, group = variant_scheme(release.config)
        plain, quantized = load_backbone_tensors(release.weight_files, self.scheme, group, mixed_plan(release.config))
        weights = {name: self._array(name, t) for name, t in plain.items()}
        for prefix, layer in quantized.items():  # named like the release so sanitize renames them with the rest
            for key in ("weight", "scales", "biases", "row_scale"):
                value = getattr(layer, key)
                if value is not None:
                    weights[f"{prefix}.{key}"] = mx.array(value)
        weights = self.model.sanitize(weights)
        self._swap_quantized(weights, quantized)
        try:
            self.model.load_weights(list(weights.items()), strict=True)
        except ValueError as exc:  # missing, unexpected or mis-shaped tensors
            raise ReleaseError(f"{release.path}: the weights do not fit mlx-lm's {self.kind} model ({exc})") from exc
        self.text = self.model.language_model.model if self.kind == "qwen3_5" else self.model.model
        lm = self.model.language_model if self.kind == "qwen3_5" else self.model
        self.output_embedding = (self.text.embed_tokens if lm.args.tie_word_embeddings else lm.lm_head).weight
        head_dim = lm.args.head_dim or lm.args.hidden_size // lm.args.num_attention_heads
        self.rope_theta = check_rope(self.model, _text_config(release.config), int(head_dim))
        mx.eval(self.model.parameters())

    def _array(self, name: str, stored: Stored) -> mx.array:
        if stored.dtype not in ("BF16", "F16", "F32", "F64", "F8_E4M3"):
            return mx.array(np.ascontiguousarray(stored.array))
        value = mx.array(stored.float32())
        return value if name.endswith(_KEEP_FLOAT32) else value.astype(self.dtype)

    def _swap_quantized(self, weights: dict[str, mx.array], quantized: Mapping[str, QuantizedLayer]) -> None:
        """Replace each quantized layer's ``nn.Linear`` (found by its sanitized ``.scales`` name) by an
        :class:`ExactQuantizedLinear` holding the stored arrays (scales, biases, row scales in the compute dtype)."""
        from mlx.utils import tree_unflatten

        paths = sorted(n.removesuffix(".scales") for n in weights if n.endswith(".scales"))
        if len(paths) != len(quantized):
            raise ReleaseError(f"{len(quantized)} quantized layers in the weights but {len(paths)} after mlx-lm's "
                               "renaming")
        modules = dict(self.model.named_modules())
        replaced = []
        for path in paths:
            linear = modules.get(path)
            if not isinstance(linear, nn.Linear):
                raise ReleaseError(f"quantized tensors {path}.* belong to no linear layer of mlx-lm's {self.kind}")
            out_f, in_f = linear.weight.shape
            packed, scales = weights[path + ".weight"], weights[path + ".scales"]
            bits = 32 * packed.shape[1] // in_f
            if packed.shape[0] != out_f or bits not in (4, 8) or bits * in_f != 32 * packed.shape[1]:
                raise ReleaseError(f"{path}: quantized weight {list(packed.shape)} does not fit the layer "
                                   f"[{out_f}, {in_f}]")
            for key in ("scales", "biases", "row_scale"):
                if path + "." + key in weights:
                    weights[path + "." + key] = weights[path + "." + key].astype(self.dtype)
            arrays = {key: weights[f"{path}.{key}"] for key in ("weight", "scales", "biases", "row_scale", "bias")
                      if f"{path}.{key}" in weights}
            replaced.append((path, ExactQuantizedLinear(arrays, in_f // scales.shape[1], bits, self.kernel)))
        self.model.update_modules(tree_unflatten(replaced))
        self.quantized_layers = len(replaced)

    def hidden_states(self, input_ids: mx.array) -> mx.array:
        """Final normed hidden states ``[B, T, hidden]`` of right-padded ``input_ids`` (causal attention)."""
        return self.text(input_ids)


class MLXBackend:
    """Runs the backbone (mlx-lm) and the head (MLX, float32) for a padded batch of encoded records."""

    name = "mlx"
    accepts_media = False  # no vision tower here: a media request is refused, naming --backend torch
    media_refusal = None  # ClefModel's line says it
    state_cache_blocker = "the MLX backend runs every state in full (the state cache is torch's)"
    batch_tokens: int | None = None  # the device's default batches (ClefModel.run)
    pad_waste: float | None = None
    load_decision: LoadDecision | None = None  # set by clef_local.backends.loader
    prefill: PrefillBudget | None = None  # set by clef_local.backends.loader

    def __init__(self, release: Release, *, device: str = "auto", dtype: str | None = None) -> None:
        self.release = release
        self.device = resolve_device(device)
        with mx.stream(self.device):
            self.backbone = MLXBackbone(release, resolve_dtype(dtype, release), default_kernel(self.device))
            self.head = load_head(release)
        self.state_identity = model_identity(release.path, release.weight_files, backend=self.name,
                                             device=str(self.device), dtype=_name(self.backbone.dtype))
        log.info("MLX %s backbone on %s in %s%s, rope_theta %s", self.backbone.kind, _name(self.device),
                 _name(self.backbone.dtype), f" ({self.backbone.scheme}, {self.backbone.kernel})"
                 if self.backbone.scheme else "", self.backbone.rope_theta)

    def logits(self, records: Sequence[EncodedRecord], layout: HeadLayout, pad_token_id: int,
               cache: StateCache | None = None) -> np.ndarray:
        """Option logits ``[questions, max_options]`` (float32, ``-inf`` padding) for right-padded ``records``."""
        if cache is not None:
            raise ValueError(self.state_cache_blocker)
        ids, mask = pad_batch(records, pad_token_id)
        with mx.stream(self.device):
            hidden = self.backbone.hidden_states(mx.array(ids.astype(np.int32)))
            lexical = self.backbone.output_embedding[mx.array(layout.option_token_ids.astype(np.int32))]
            logits = self.head(hidden, mask, lexical, layout)
            mx.eval(logits)
        return np.array(logits.astype(mx.float32), copy=True)

    def describe(self) -> dict[str, Any]:
        from mlx.utils import tree_flatten

        params = sum(int(v.size) for _, v in tree_flatten(self.backbone.model.parameters()))
        out = {"backend": self.name, "device": _name(self.device), "backbone_dtype": _name(self.backbone.dtype),
               "backbone_parameters": params, "head_parameters": self.head.parameters, "head_dtype": "float32",
               "mlx_architecture": self.backbone.kind, "rope_theta": self.backbone.rope_theta,
               "mlx_version": mx.__version__, "platform": f"{platform.system()} {platform.machine()}"}
        scheme = self.backbone.scheme
        if scheme is not None:
            if scheme == MIXED or registry.get(scheme).mlx_quantized:
                kernels = {f"{scheme}:{self.backbone.kernel}": self.backbone.quantized_layers}
            else:
                kernels = {f"{scheme}:dequantize_at_load": _dequantized_count(self.release)}
            out.update(scheme=scheme, kernels=kernels)
        return out


def _dequantized_count(release: Release) -> int:
    member = (release.quantization or {}).get("clef_local") or {}
    return int(member.get("quantized", 0))


def _name(value: mx.Device | mx.Dtype) -> str:
    """``cpu``/``gpu`` for a device, ``float32``… for a dtype (MLX's reprs carry module and type prefixes)."""
    if isinstance(value, mx.Device):
        return str(value.type).rsplit(".", 1)[-1]
    return str(value).rsplit(".", 1)[-1]
