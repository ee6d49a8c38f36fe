"""A backbone built on the meta device from its ``config.json``: the architecture without memory, a variant's
quantized linears swapped in (:func:`clef_local.backends.quantized.swap_linears`), then the stored tensors assigned
as they are (:func:`load_variant_backbone`), or a layer at a time by :mod:`clef_local.backends.streaming`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from clef_local.backends.quantized import quantized_prefixes, swap_linears
from clef_local.backends.quantized_embeddings import dequantize_embeddings, embedding_prefixes
from clef_local.errors import ReleaseError, one_line
from clef_local.formats import mlx_layout
from clef_local.formats.safetensors import DTYPES as SAFETENSORS_DTYPES
from clef_local.formats.safetensors import read_header

if TYPE_CHECKING:
    from clef_local.formats.quant_plan import LayerFormat


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (:data:`clef_local.formats.safetensors.DTYPES`)."""
    dtype = getattr(torch, SAFETENSORS_DTYPES[name].torch, None)
    if not isinstance(dtype, torch.dtype):
        raise ReleaseError(f"safetensors dtype {name} has no torch dtype in torch {torch.__version__}")
    return dtype


def read_headers(files: Sequence[Path]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{tensor name: (shape, dtype)} from the safetensors headers of ``files``, each checked against its file
    (:func:`clef_local.formats.safetensors.read_header`: a truncated or garbled file is a ``ReleaseError``); no
    tensor data is read. Tensors in MLX's layout (an mlx-vlm conversion) are given under the release's names and
    shapes (:mod:`clef_local.formats.mlx_layout`), as :func:`read_shard` returns them."""
    headers: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for file in files:
        for name, info in read_header(file).tensors.items():
            fix = mlx_layout.restore(name, info.shape)
            headers[mlx_layout.release_name(name)] = (fix.shape(info.shape) if fix else info.shape,
                                                      torch_dtype(info.dtype))
    return headers


class Skeleton(NamedTuple):
    """What :func:`build_skeleton` built: the model on the meta device, the weight files' headers ({name: (shape,
    dtype)}), the quantized modules the headers name ({path: scheme}; empty for a full-precision release) and, of
    those, the int4 embeddings an mlx-lm conversion stores (kept as ``nn.Embedding``, dequantized at load)."""

    model: Any
    headers: dict[str, tuple[tuple[int, ...], torch.dtype]]
    quantized: dict[str, str]
    embeddings: set[str]


def build_skeleton(cls: Any, path: Path, weight_files: Sequence[Path], scheme: str | None,
                   dtype: torch.dtype, plan: Mapping[int, LayerFormat] | None = None) -> Skeleton:
    """``cls`` built from ``path``'s ``config.json`` on the meta device in ``dtype`` (no memory), with a variant's
    quantized linears swapped in (``scheme`` None: a full-precision release, nothing swapped; ``plan``: a mixed
    variant's format per decoder layer, :func:`clef_local.formats.quant_plan.mixed_plan`), and the headers of
    ``weight_files``, each checked against its file."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ReleaseError(f"{path}: the backbone config cannot be read ({one_line(exc)})") from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # built plain: our modules replace the linears, not transformers' quantizer
    with torch.device("meta"):
        if cls is transformers.AutoModelForCausalLM:
            model = cls.from_config(config, dtype=dtype, trust_remote_code=False)
        else:
            model = cls._from_config(config, dtype=dtype)
    headers = read_headers(weight_files)
    if scheme is None:
        return Skeleton(model, headers, {}, set())
    prefixes = quantized_prefixes(headers, scheme, plan)
    embeddings = embedding_prefixes(model, prefixes)  # mlx-lm's int4 embeddings stay nn.Embedding
    swap_linears(model, {p: s for p, s in prefixes.items() if p not in embeddings}, headers, dtype=dtype)
    return Skeleton(model, headers, prefixes, embeddings)


def load_variant_backbone(cls: Any, path: Path, weight_files: Sequence[Path], scheme: str,
                          dtype: torch.dtype, plan: Mapping[int, LayerFormat] | None = None) -> Any:
    """Build a variant's backbone on the meta device, swap its quantized linears, assign the stored tensors.

    Every tensor of every shard is assigned as stored (``load_state_dict(assign=True)``), except floating tensors of
    unquantized modules, cast to the dtype the model was built in (as ``from_pretrained`` does); the quantized
    layers receive their packed tensors untouched, so no full-precision copy of them ever exists. Non-persistent
    buffers (rotary ``inv_freq``) are recomputed by the model's own ``_init_weights``; tied embeddings are re-tied.
    The model stays on the CPU; the caller moves it and then calls ``prepare_quantized``. ``plan``: a mixed
    variant's format per decoder layer (:func:`clef_local.formats.quant_plan.mixed_plan`).
    """
    model, _, quantized, embeddings = build_skeleton(cls, path, weight_files, scheme, dtype, plan)
    expected = model.state_dict(keep_vars=True)
    for file in weight_files:
        try:
            state = read_shard(file, tuple(f"{prefix}." for prefix in quantized))
        except Exception as exc:  # truncated data past a valid header
            raise ReleaseError(f"{file}: cannot read tensor data ({exc})") from exc
        dequantize_embeddings(state, embeddings, dtype)
        unexpected = sorted(set(state) - set(expected))
        if unexpected:
            raise ReleaseError(f"{file}: tensors the backbone does not have: {', '.join(unexpected[:10])}")
        for name, tensor in state.items():
            target = expected[name]
            if tensor.is_floating_point() and target.is_floating_point() and tensor.dtype != target.dtype:
                state[name] = tensor.to(target.dtype)
        try:
            model.load_state_dict(state, strict=False, assign=True)
        except RuntimeError as exc:  # size mismatches
            raise ReleaseError(f"{file}: does not fit the backbone ({exc})") from exc
        del state
    model.tie_weights()
    materialize_non_persistent_buffers(model)
    missing = [name for name, t in model.state_dict(keep_vars=True).items() if t is not None and t.is_meta]
    if missing:
        raise ReleaseError(f"{path}: tensors missing from the weight files: {', '.join(missing[:10])}")
    return model


def read_shard(file: Path, copied: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """A shard's tensors: those whose names start with one of ``copied`` (the quantized linears') read into memory
    of their own, the rest mapped from the file.

    Mapped tensors share the file's mapping, and every page they touched stays resident while any of them lives. The
    stored codes of a quantized linear are replaced at ``prepare()`` (torch's CPU int4 kernel and tinygemm repack
    them) or by a move to a GPU, so mapped they would stay resident beside their replacement: read on their own
    (safetensors' ``pread`` backend) they are freed when replaced.

    Tensors in MLX's layout come back under the release's names and in its shapes (:func:`release_layout`);
    ``copied`` names the release's paths.
    """
    from safetensors import safe_open

    with safe_open(str(file), framework="pt", backend="mmap") as mapped:
        names = list(mapped.keys())
        state = {name: mapped.get_tensor(name) for name in names
                 if not mlx_layout.release_name(name).startswith(copied)}
    if len(state) < len(names):
        with safe_open(str(file), framework="pt", backend="pread") as read:
            state.update((name, read.get_tensor(name)) for name in names
                         if mlx_layout.release_name(name).startswith(copied))
    return release_layout(state)


def release_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (one weight file's tensors) with those stored in MLX's layout (an mlx-vlm conversion) under the
    release's names, axes and RMSNorm convention (:mod:`clef_local.formats.mlx_layout`); the others as they are. A
    norm comes back in float32 (the stored ``1 + w`` less 1, exact), cast to the model's dtype with the rest."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        fix = mlx_layout.restore(name, tuple(tensor.shape))
        if fix is not None and fix.permute:
            tensor = tensor.permute(*fix.permute).contiguous()
        if fix is not None and fix.offset:
            tensor = tensor.float() - fix.offset
        out[mlx_layout.release_name(name)] = tensor
    return out


def materialize_non_persistent_buffers(model: Any) -> None:
    """Recompute the buffers that no checkpoint holds (rotary ``inv_freq``/``original_inv_freq``) on the CPU.

    They are created empty and filled by the model's own ``_init_weights`` (what ``from_pretrained`` does for
    them), which is only safe on a module holding nothing else: any other module is an error, not a guess.
    """
    owners: dict[str, Any] = {}
    for name, buffer in model.named_buffers():
        module_name, _, buffer_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        if buffer.is_meta and buffer_name in module._non_persistent_buffers_set:
            owners[module_name] = module
    for module_name, module in owners.items():
        held = [n for n, _ in module.named_parameters(recurse=False)]
        held += [n for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
        if held or list(module.children()):
            raise ReleaseError(f"cannot recompute the non-persistent buffers of {module_name} "
                               f"({type(module).__name__}): it also holds {held or 'submodules'}")
        for buffer_name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(buffer_name)
            if buffer is not None and buffer.is_meta:
                module._buffers[buffer_name] = torch.empty_like(buffer, device="cpu")
        with torch.no_grad():
            model._init_weights(module)
