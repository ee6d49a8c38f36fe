"""Weight bytes of a release or variant, by role, without loading a tensor (the memory planner's first half): exact
from the safetensors headers (:func:`census_from_release`; other schemes by the byte formulas of
docs/quantization.md#schemes), or from a bare config.json built on the meta device (:func:`census_from_config`).
The roles: docs/hardware.md#clef-local-plan.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clef_local.errors import ReleaseError
from clef_local.formats.mlx_layout import release_name
from clef_local.formats.quant_plan import layer_groups, mixed_plan, span
from clef_local.formats.safetensors import TensorInfo, read_header
from clef_local.formats.variant import variant_format
from clef_local.quant import registry

FORMATS = ("bf16", *registry.by_precision())  # best precision first
DEFAULT_GROUP_SIZE = 64
TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
INT4_PER_WORD = 8  # 4-bit codes per uint32 word (MLX's affine layout)
DEQUANTIZED_ITEMSIZE = 2  # an int4 embedding is counted as a 16-bit matrix, the unit of every floating role
# every scheme's tensors stored beside a quantized linear's weight
_MARKERS = tuple(dict.fromkeys(suffix for row in registry.SCHEMES.values() for suffix in row.extra_tensors))


@dataclass(frozen=True)
class WeightCensus:
    """Bytes of a backbone (and its head) by role, for one storage format.

    ``fmt`` is ``bf16`` (as released, whatever the stored float dtype) or a scheme; ``source`` says where the
    numbers come from; ``exact`` is true when they are the sum of stored tensor sizes (an int4 embedding, which the
    loaders dequantize, counted exactly as the 16-bit matrix it becomes: :func:`dequantized_bytes`).
    """

    fmt: str
    source: str
    exact: bool
    quantized_linears: int  # the text linears the scheme quantizes (their packed tensors and scales)
    text_other: int  # the rest of the text model: kept linears, norms, conv1d, A_log, ...
    embed_tokens: int  # as held: an int4 embedding (mlx-lm / mlx-vlm) as the 16-bit matrix it dequantizes to
    lm_head: int  # 0 when tied to embed_tokens
    vision: int
    head: int  # the joint schema head in float32 (as it runs)
    head_stored: int = 0  # joint_head.safetensors' tensors as stored
    params: dict[str, int] = field(default_factory=dict)  # parameter counts by role (config source only)
    layers: tuple[int, ...] = ()  # bytes of each decoder layer of the text model (part of the two text roles)
    float_bytes: int = 2  # bytes per element of the stored floating tensors (2: BF16/F16, 4: F32)
    # why the stored tensors cannot be streamed from disk ("": they can): a streamed run reads them as stored, and an
    # ecosystem conversion has tensors the loaders transform at load
    unstreamable: str = ""

    @property
    def text_rest(self) -> int:
        """Text-model bytes outside the decoder layers (the final norm, ...): they sit with the last layer."""
        return self.quantized_linears + self.text_other - sum(self.layers)

    @property
    def backbone(self) -> int:
        """Every backbone byte (what the weight files hold; int4 embeddings as the matrix they dequantize to)."""
        return self.quantized_linears + self.text_other + self.embed_tokens + self.lm_head + self.vision

    def device_weights(self, *, host_embeddings: bool, media: bool) -> int:
        """Bytes that must sit on the compute device: the text model, the head, and optionally the rest."""
        total = self.quantized_linears + self.text_other + self.head
        if not host_embeddings:
            total += self.embed_tokens + self.lm_head
        if media:
            total += self.vision
        return total

    def host_weights(self, *, host_embeddings: bool, media: bool) -> int:
        """Bytes kept in host memory instead: embeddings and ``lm_head`` (only gathered), the idle vision tower."""
        total = self.embed_tokens + self.lm_head if host_embeddings else 0
        return total + (0 if media else self.vision)


def should_quantize(name: str, shape: tuple[int, ...], group_size: int | None) -> tuple[bool, str]:
    """:func:`clef_local.quant.predicate.should_quantize` (pure Python: no torch needed)."""
    from clef_local.quant import predicate

    return predicate.should_quantize(name, shape, group_size)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder layer a text-model tensor belongs to (``...layers.N....``), or None."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def _per_layer(sizes: Iterable[tuple[str, int]]) -> tuple[int, ...]:
    """Bytes per decoder layer from (text tensor name, bytes) pairs; layers without a tensor count 0."""
    totals: dict[int, int] = {}
    for name, size in sizes:
        index = layer_index(name)
        if index is not None:
            totals[index] = totals.get(index, 0) + size
    return tuple(totals.get(i, 0) for i in range(max(totals) + 1)) if totals else ()


def _role(name: str) -> str:
    parts = name.split(".")
    if name.startswith("lm_head."):
        return "lm_head"
    if "embed_tokens" in parts:
        return "embed_tokens"
    if any(p in ("visual", "vision_tower", "vision_model") for p in parts):
        return "vision"
    return "text"


def _quantized_prefixes(names: Iterable[str]) -> set[str]:
    """Module paths that hold a scheme's extra tensors (``.scales``, ``.weight_scale``, ``.weight.absmax``, ...)."""
    prefixes = set()
    for name in names:
        for marker in _MARKERS:
            if name.endswith(marker) or (marker == ".weight.quant_state" and marker + "." in name):
                prefixes.add(name[: name.index(marker)])
    return prefixes


def quantized_bytes(fmt: str, out_features: int, in_features: int, source_bytes: int,
                    group_size: int = DEFAULT_GROUP_SIZE, source_dtype: str = "bfloat16") -> int:
    """Stored bytes of one ``[out, in]`` weight in ``fmt`` (formulas in the module docstring)."""
    if fmt == "bf16":
        return out_features * in_features * source_bytes
    if fmt not in registry.SCHEMES:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return registry.get(fmt).stored_bytes(out_features, in_features, source_bytes, group_size, source_dtype)


def _predicate_group(fmt: str, group_size: int) -> int | None:
    # only groups that run along the input dimension (int4's) constrain which linears are quantized
    return registry.get(fmt).predicate_group_size(group_size) if fmt in registry.SCHEMES else None


def census_from_shapes(shapes: Mapping[str, tuple[tuple[int, ...], int]], fmt: str, *, head: int,
                       head_stored: int = 0, group_size: int = DEFAULT_GROUP_SIZE, source: str,
                       source_dtype: str = "bfloat16", exact: bool = False) -> WeightCensus:
    """Census of full-precision tensors ``{name: (shape, bytes per element)}`` stored as ``fmt``."""
    roles = {"quantized": 0, "text": 0, "embed_tokens": 0, "lm_head": 0, "vision": 0}
    params = dict.fromkeys(("text_linears", "text_other", "embed_tokens", "lm_head", "vision"), 0)
    text: list[tuple[str, int]] = []
    for name, (shape, size) in shapes.items():
        numel = math.prod(shape)
        role = _role(name)
        if role != "text":
            roles[role] += numel * size
            params[role] += numel
            continue
        linear, _ = should_quantize(name, shape, None)
        params["text_linears" if linear else "text_other"] += numel
        quantize = fmt != "bf16" and should_quantize(name, shape, _predicate_group(fmt, group_size))[0]
        nbytes = (quantized_bytes(fmt, shape[0], shape[1], size, group_size, source_dtype) if quantize
                  else numel * size)
        # bf16: the same linears, as released, are the part a scheme would shrink
        roles["quantized" if quantize or (linear and fmt == "bf16") else "text"] += nbytes
        text.append((name, nbytes))
    return WeightCensus(fmt=fmt, source=source, exact=exact and fmt == "bf16", quantized_linears=roles["quantized"],
                        text_other=roles["text"], embed_tokens=roles["embed_tokens"], lm_head=roles["lm_head"],
                        vision=roles["vision"], head=head, head_stored=head_stored, params=params,
                        layers=_per_layer(text), float_bytes=TORCH_DTYPE_BYTES.get(source_dtype, 2))


def stored_format(config: Mapping[str, Any]) -> str:
    """``bf16`` for a release, else the variant's scheme (:func:`clef_local.formats.variant.variant_format`;
    ``mixed`` for a variant with a format per layer group, :mod:`clef_local.formats.quant_plan`)."""
    fmt = variant_format(config)
    return "bf16" if fmt is None else fmt.scheme


def census_from_release(path: Path, weight_files: Iterable[Path], config: Mapping[str, Any], fmt: str | None = None,
                        *, group_size: int = DEFAULT_GROUP_SIZE) -> WeightCensus:
    """Census of a release directory from its safetensors headers.

    ``fmt`` None (or the stored format) reads every tensor as stored: exact. Another format is only possible for a
    full-precision release and is computed from its stored shapes.
    """
    headers: dict[str, TensorInfo] = {}
    for file in weight_files:
        headers.update(read_header(Path(file)).tensors)
    head_info = read_header(path / "joint_head.safetensors").tensors
    head_stored = sum(t.nbytes for t in head_info.values())
    head = sum(4 * math.prod(t.shape) for t in head_info.values())
    stored = stored_format(config)
    if fmt is None or fmt == stored:
        return _census_as_stored(headers, stored, head, head_stored)
    if stored != "bf16":
        raise ReleaseError(f"{path} is a {stored} variant: its {fmt} size cannot be read from it; plan the "
                           f"full-precision release it came from (--model SOURCE --format {fmt})")
    float_dtypes = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    source_dtype = next((float_dtypes[t.dtype] for t in headers.values() if t.dtype in float_dtypes), "bfloat16")
    shapes = {name: (t.shape, t.spec.itemsize) for name, t in headers.items()}
    return census_from_shapes(shapes, fmt, head=head, head_stored=head_stored, group_size=group_size,
                              source="safetensors headers (shapes) + scheme formulas", source_dtype=source_dtype)


def dequantized_bytes(info: TensorInfo) -> int:
    """Bytes an int4 embedding's packed ``weight`` (uint32 ``[rows, columns / 8]``) is counted as: the 16-bit
    ``[rows, columns]`` matrix the backends dequantize it to at load (:func:`held_weights
    <clef_local.planning.estimate.held_weights>` scales it to the compute dtype, like the release's floats)."""
    if info.dtype != "U32" or len(info.shape) != 2:
        raise ReleaseError(f"an int4 embedding's weight is uint32 [rows, columns / {INT4_PER_WORD}], not {info.dtype} "
                           f"{list(info.shape)}; convert the release again")
    return info.shape[0] * info.shape[1] * INT4_PER_WORD * DEQUANTIZED_ITEMSIZE


def _census_as_stored(headers: Mapping[str, TensorInfo], fmt: str, head: int, head_stored: int) -> WeightCensus:
    renamed = any(release_name(name) != name for name in headers)
    headers = {release_name(name): info for name, info in headers.items()}  # an mlx-vlm conversion's names
    prefixes = _quantized_prefixes(headers) if fmt != "bf16" else set()
    int4_embeddings = any(_role(p + ".weight") in ("embed_tokens", "lm_head") for p in prefixes)
    unstreamable = ("its tensors are in MLX's layout (an mlx-vlm conversion), converted at load" if renamed
                    else "its embeddings are int4 (an mlx-lm conversion), dequantized at load" if int4_embeddings
                    else "")
    roles = {"quantized": 0, "text": 0, "embed_tokens": 0, "lm_head": 0, "vision": 0}
    for name, info in headers.items():
        role = _role(name)
        prefix, _, part = name.rpartition(".")
        if role in ("embed_tokens", "lm_head") and prefix in prefixes:
            # mlx-lm / mlx-vlm quantize the embeddings; the loaders hold them dequantized, not as stored
            roles[role] += dequantized_bytes(info) if part == "weight" else 0
        elif role != "text":
            roles[role] += info.nbytes
        elif fmt == "bf16":
            roles["quantized" if should_quantize(name, info.shape, None)[0] else "text"] += info.nbytes
        else:
            roles["quantized" if any(name.startswith(p + ".") for p in prefixes) else "text"] += info.nbytes
    return WeightCensus(fmt=fmt, source="safetensors headers (as stored)", exact=True,
                        quantized_linears=roles["quantized"], text_other=roles["text"],
                        embed_tokens=roles["embed_tokens"], lm_head=roles["lm_head"], vision=roles["vision"],
                        head=head, head_stored=head_stored,
                        layers=_per_layer((n, i.nbytes) for n, i in headers.items() if _role(n) == "text"),
                        float_bytes=_float_bytes(headers.values()), unstreamable=unstreamable)


def _float_bytes(infos: Iterable[TensorInfo]) -> int:
    """The item size most of the stored floating bytes have (2 for a BF16 release, 4 for float32); 2 without any."""
    sizes: dict[int, int] = {}
    for info in infos:
        if info.spec.floating and info.spec.itemsize >= 2:
            sizes[info.spec.itemsize] = sizes.get(info.spec.itemsize, 0) + info.nbytes
    return max(sizes, key=lambda k: sizes[k]) if sizes else 2


@functools.lru_cache(maxsize=8)
def meta_shapes(config_path: Path) -> tuple[dict[str, tuple[tuple[int, ...], int]], str]:
    """{parameter name: (shape, bytes per element)} of the architecture in ``config_path`` built on the meta device
    (tied weights once), and the stored dtype's name."""
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(config_path), trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ReleaseError(f"{config_path}: not a config transformers can read ({exc})") from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    text = getattr(config, "text_config", None) or config
    dtype_name = str(getattr(text, "dtype", None) or getattr(config, "dtype", None) or "bfloat16")
    dtype_name = dtype_name.removeprefix("torch.")
    dtype = getattr(torch, dtype_name, torch.bfloat16)
    architecture = (getattr(config, "architectures", None) or [""])[0]
    with torch.device("meta"):
        cls = getattr(transformers, architecture, None)
        if cls is not None and hasattr(cls, "_from_config"):
            model = cls._from_config(config, dtype=dtype)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    size = TORCH_DTYPE_BYTES.get(dtype_name, 2)
    return {name: (tuple(p.shape), size) for name, p in model.named_parameters()}, dtype_name


def head_float32_bytes(head_config_path: Path) -> int:
    """The joint schema head's float32 bytes, from its config (built on the meta device)."""
    import torch

    from clef_local.formats.release import read_head_config
    from clef_local.heads.torch_head import JointSchemaHead

    with torch.device("meta"):
        head = JointSchemaHead(read_head_config(head_config_path))
    return 4 * sum(p.numel() for p in head.parameters())


def census_from_config(config_path: Path, fmt: str, *, head_config_path: Path | None = None,
                       group_size: int = DEFAULT_GROUP_SIZE,
                       shapes: tuple[dict[str, tuple[tuple[int, ...], int]], str] | None = None) -> WeightCensus:
    """Census of the architecture in a bare ``config.json`` stored as ``fmt`` (``shapes``: a cached
    :func:`meta_shapes` result, to count several formats from one meta build)."""
    named, dtype_name = shapes or meta_shapes(config_path)
    head = head_float32_bytes(head_config_path) if head_config_path is not None else 0
    return census_from_shapes(named, fmt, head=head, group_size=group_size, source_dtype=dtype_name,
                              source="config.json on the meta device")


def precision_groups(config: Mapping[str, Any], census: WeightCensus) -> list[dict[str, Any]]:
    """A mixed variant's consecutive layers of one format with their stored bytes (from ``census.layers``, as
    stored): ``[{"layers": "0-3", "format": "int4 g32", "bytes": n}, …]``; empty for any other release."""
    plan = mixed_plan(config)
    if not plan:
        return []
    sizes = census.layers
    return [{"layers": span(layers), "format": fmt.label,
             "bytes": sum(sizes[i] for i in layers if i < len(sizes))} for layers, fmt in layer_groups(plan)]
