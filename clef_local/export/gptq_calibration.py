"""``clef-local quantize --calibrate``: GPTQ's inputs, one decoder layer at a time.

Calibration requests from the training splits (:func:`calibration_requests`) run once through the model, recording
every decoder layer's call; each layer is then replayed with hooks summing ``x xᵀ`` at its quantized linears, so only
one layer's Hessians exist at once. Whose inputs each layer sees, and why: docs/quantization.md#gptq---calibrate.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_local.export.staging import ExportError

if TYPE_CHECKING:
    import torch

    from clef_local.formats.release import Release

log = logging.getLogger(__name__)

FLOAT32_HEADROOM = 1.3  # float32 weights × this must fit in free memory (activations, Hessians, the packed copy)
REQUESTS = 128  # enough tokens for Hessians of full rank at every input width, in minutes on a CPU
SEED = 0  # fixed: the same source and settings give the same variant


@dataclass
class Calibration:
    """What :func:`gptq_tensors` returns: packed tensors per weight name and how much GPTQ helped."""

    packed: dict[str, dict[str, torch.Tensor]]
    requests: int
    tokens: int
    damp: float
    seconds: float
    sequential: bool = False
    dtype: str = "float32"  # the backbone's compute dtype while the Hessians were collected
    # per weight: (round-to-nearest, GPTQ) output error tr(ΔW H ΔWᵀ) on the calibration inputs
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)
    rounded: list[str] = field(default_factory=list)  # nf4 weights whose rows are not whole blocks: no GPTQ

    def config(self) -> dict[str, Any]:
        """The ``quantization_config.clef_local.calibration`` entry of the variant's config.json."""
        return {"method": "gptq", "inputs": "quantized layers" if self.sequential else "reference layers",
                "requests": self.requests, "dtype": self.dtype,
                "tokens": self.tokens, "seed": SEED, "damp": self.damp,
                "data": "BANKING77 train, NLU++ folds 0-15 (clef_local.export.gptq_calibration)",
                "output_error_ratio": round(self.error_ratio(), 4), "round_to_nearest": self.rounded}

    def error_ratio(self) -> float:
        """Summed GPTQ output error over summed round-to-nearest output error (below 1: GPTQ helped)."""
        rtn = sum(r for r, _ in self.errors.values())
        return sum(g for _, g in self.errors.values()) / rtn if rtn else 1.0


def calibration_dtype(source: Path | Release, device: str) -> tuple[str | None, str]:
    """(dtype, why): float32 when the source in float32 fits in free memory, else the source's own dtype (None).

    float32 activations give GPTQ much better Hessians where the grid is coarse (docs/benchmarks.md, GPTQ: the demo
    model's int4 g64 drifted about half as much calibrated in float32 as in bfloat16).
    """
    import torch

    from clef_local.formats.release import Release, read_release
    from clef_local.planning.hardware import host_memory

    release = source if isinstance(source, Release) else read_release(source)
    params = release.weight_bytes // 2  # BF16/FP16 releases: 2 bytes a weight
    needed = int(FLOAT32_HEADROOM * 4 * params)
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    free = torch.cuda.mem_get_info()[0] if on_cuda else host_memory()[1]
    if needed > free:
        return None, f"float32 needs ~{needed / 1e9:.1f} GB, {free / 1e9:.1f} GB free: the source's dtype"
    return "float32", f"float32 (~{needed / 1e9:.1f} GB of {free / 1e9:.1f} GB free)"


def calibration_requests(n: int = REQUESTS, seed: int = SEED, root: Path | None = None) -> list[dict[str, Any]]:
    """``n`` requests from the training splits, in the validation probes' shapes
    (:func:`clef_local.data.probes.probe_requests`)."""
    from clef_local.data.probes import probe_requests

    return probe_requests(n, seed, root, split="train")


class _Stop(Exception):
    """Raised by the recording hook once the last decoder layer has been called: nothing after it is needed."""


def _record_layer_calls(text_model: Any, layers: Any, input_ids: list[torch.Tensor]
                        ) -> tuple[list[torch.Tensor], list[list[dict[str, Any]]]]:
    """Layer 0's input hidden states and every layer's keyword arguments, per request (one forward each)."""
    import torch

    hidden: list[torch.Tensor] = []
    kwargs: list[list[dict[str, Any]]] = []
    last = len(layers) - 1

    def record(index: int):
        def hook(module: Any, args: tuple, kw: dict[str, Any]) -> None:
            if len(args) > 1:
                raise ExportError(f"decoder layer {index} is called with {len(args)} positional arguments; "
                                  f"calibration replays keyword arguments only")
            kw = {**kw}
            states = args[0] if args else kw.pop("hidden_states")
            if index == 0:
                hidden.append(states.detach())
            kwargs[-1].append(kw)
            if index == last:
                raise _Stop
        return hook

    hooks = [layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.inference_mode():
            for ids in input_ids:
                kwargs.append([])
                with contextlib.suppress(_Stop):
                    text_model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return hidden, kwargs


def _layer_output(out: Any) -> torch.Tensor:
    """A decoder layer's hidden states, whether it returns a tensor (transformers 5) or a tuple."""
    return out[0] if isinstance(out, tuple) else out


def _run_layer(layer: Any, hidden: list[torch.Tensor], kwargs: list[dict[str, Any]]) -> list[torch.Tensor]:
    import torch

    with torch.inference_mode():
        return [_layer_output(layer(h, **kw)) for h, kw in zip(hidden, kwargs, strict=True)]


def _hessians(layer: Any, modules: dict[str, Any], hidden: list[torch.Tensor], kwargs: list[dict[str, Any]]
              ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """``E[x xᵀ]`` (float32) of each module's inputs over the calibration tokens, and the layer's outputs, by running
    ``layer`` once."""
    import torch

    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    last: list[Any] = [None, None]  # (input, x xᵀ): q/k/v and gate/up read one tensor, one after the other

    def accumulate(name: str):
        def hook(module: Any, args: tuple) -> None:
            if args[0] is not last[0]:
                x = args[0].reshape(-1, args[0].shape[-1]).to(torch.float32)
                last[:] = [args[0], x.T @ x]
            sums[name] = sums[name] + last[1] if name in sums else last[1].clone()
            counts[name] = counts.get(name, 0) + args[0].numel() // args[0].shape[-1]
        return hook

    hooks = [module.register_forward_pre_hook(accumulate(name)) for name, module in modules.items()]
    try:
        outputs = _run_layer(layer, hidden, kwargs)
    finally:
        for hook in hooks:
            hook.remove()
        last.clear()
    missing = [name for name in modules if name not in sums]
    if missing:
        raise ExportError(f"calibration: {', '.join(missing)} never ran in its decoder layer")
    return {name: sums[name] / counts[name] for name in modules}, outputs


def gptq_tensors(source: Path | Release, scheme: str, group_size: int | None, options: dict[str, Any], *,
                 requests: int = REQUESTS, damp: float | None = None, device: str = "auto",
                 dtype: str | None = None, sequential: bool = False) -> Calibration:
    """GPTQ-quantize every linear weight the predicate selects in the release at ``source`` (a directory, or the
    :class:`Release` already read: not read again).

    Returns the scheme's packed tensors per weight name (``model.layers.0.self_attn.q_proj.weight`` → its keys).
    ``options`` are the scheme's (int4: ``grid``); ``dtype`` the backbone's compute dtype (default:
    :func:`calibration_dtype`, float32 where it fits);
    ``sequential`` feeds each layer the quantized outputs of the layers before it (default: the reference's).
    ExportError when the scheme has no GPTQ grid, the datasets are missing, or the backbone's decoder layers cannot
    be found.
    """
    import torch
    from tqdm import tqdm

    import clef_local
    from clef_local.backends.skeleton import read_headers
    from clef_local.backends.torch_backend import TorchBackend
    from clef_local.formats.release import Release, read_release
    from clef_local.quant import get as get_scheme
    from clef_local.quant import gptq, predicate

    if scheme not in gptq.SCHEMES:
        raise ExportError(f"--calibrate (GPTQ) covers {', '.join(gptq.SCHEMES)}, not {scheme}: drop --calibrate "
                          f"to quantize {scheme} round-to-nearest")
    if requests < 1:
        raise ExportError(f"--calibration-requests must be at least 1, not {requests}")
    damp = gptq.DEFAULT_DAMP if damp is None else damp
    release = source if isinstance(source, Release) else read_release(source)
    source = release.path
    if dtype is None:
        dtype, why = calibration_dtype(release, device)
        log.info("calibration compute dtype: %s", why)
    try:
        batch = calibration_requests(requests)
    except FileNotFoundError as exc:
        raise ExportError(f"--calibrate needs the calibration data: {exc}") from None
    started = time.perf_counter()
    spec = get_scheme(scheme)
    group = spec.predicate_group_size(group_size)
    model = clef_local.load(release, backend="torch", device=device, dtype=dtype)
    if not isinstance(model.backend, TorchBackend):
        raise ExportError(f"GPTQ calibration runs on the torch backend, not {model.backend.name}")
    backbone = model.backend.backbone
    layers = getattr(backbone.text_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ExportError(f"{source}: the text model has no decoder layers list (.layers); cannot calibrate")
    device_ = backbone.device
    input_ids = [torch.tensor([model.encode(r).input_ids], device=device_) for r in batch]
    tokens = sum(ids.shape[1] for ids in input_ids)
    log.info("calibrating %s on %d requests (%d tokens)", scheme, len(batch), tokens)
    hidden, calls = _record_layer_calls(backbone.text_model, layers, input_ids)
    names = dict(backbone.model.named_modules())
    stored = read_headers(model.release.weight_files)  # name -> (shape, dtype) as the shards store them
    result = Calibration(packed={}, requests=len(batch), tokens=tokens, damp=damp, seconds=0.0, sequential=sequential,
                         dtype=str(backbone.dtype).removeprefix("torch."))
    for index, layer in enumerate(tqdm(layers, desc="GPTQ", unit="layer", disable=None, dynamic_ncols=True)):
        prefix = next(name for name, module in names.items() if module is layer)
        linear = {f"{prefix}.{sub}": module for sub, module in layer.named_modules()
                  if isinstance(module, torch.nn.Linear)
                  and predicate.should_quantize(f"{prefix}.{sub}.weight", tuple(module.weight.shape), group)[0]}
        layer_calls = [c[index] for c in calls]
        if not linear:
            hidden = _run_layer(layer, hidden, layer_calls)
            continue
        hessians, outputs = _hessians(layer, linear, hidden, layer_calls)
        for full, module in linear.items():
            # in the stored dtype (exact: float32 compute only widened it), so scales, biases and nf4's state are
            # stored as round-to-nearest stores them
            if f"{full}.weight" not in stored:
                raise ExportError(f"{source}: no tensor {full}.weight in the weight files for the module {full}")
            weight = module.weight.detach().to(stored[f"{full}.weight"][1])
            if spec.flattened_blocks and weight.shape[1] % (group_size or spec.default_group_size or 1):
                log.warning("%s: %d input columns are not whole %s blocks; rounded to nearest", full, weight.shape[1],
                            scheme)
                result.rounded.append(f"{full}.weight")
                result.packed[f"{full}.weight"] = spec.quantize(weight.cpu(), group_size)
                continue
            packed = gptq.quantize(weight, hessians[full], scheme, group_size, damp=damp, **options)
            approx = spec.dequantize(packed, group_size, torch.float32)
            rtn = spec.dequantize(spec.quantize(weight, group_size, **options), group_size, torch.float32)
            result.errors[f"{full}.weight"] = (gptq.output_error(weight, rtn, hessians[full]),
                                               gptq.output_error(weight, approx, hessians[full]))
            result.packed[f"{full}.weight"] = {k: v.cpu() for k, v in packed.items()}
            if sequential:
                with torch.no_grad():
                    module.weight.copy_(approx.to(module.weight.dtype))
        hidden = _run_layer(layer, hidden, layer_calls) if sequential else outputs
    result.seconds = time.perf_counter() - started
    log.info("GPTQ: %d weights in %.0f s, output error %.3f× round-to-nearest's", len(result.packed),
             result.seconds, result.error_ratio())
    return result
