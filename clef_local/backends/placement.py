"""Where the torch backend's modules live: one device, host embeddings, a pipeline split (:func:`place_pipeline`:
forward pre-hooks move each layer's inputs, the rotary cos/sin and masks once per device per forward), and the CUDA
allocator cap of ``--max-memory``. docs/hardware.md#two-cards and #memory-caps.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

Stage = tuple[str, int, int]  # (device, first layer, end layer): layers [first, end) run there


def to_device_except(module: nn.Module, device: torch.device, keep: set[int]) -> None:
    """Move ``module`` to ``device`` except the submodules whose ``id`` is in ``keep`` (they stay where they are)."""
    for child in module.children():
        if id(child) in keep:
            continue
        if any(id(m) in keep for m in child.modules()):
            to_device_except(child, device, keep)
        else:
            child.to(device)
    for name, param in module._parameters.items():
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to(device), requires_grad=param.requires_grad)
    for name, buffer in module._buffers.items():
        if buffer is not None:
            module._buffers[name] = buffer.to(device)


def move(value: Any, device: torch.device, memo: dict[int, tuple[Any, Any]]) -> Any:
    """``value`` with every tensor in it (nested in tuples, lists, dicts) on ``device``; a tensor moved before in the
    same forward (``memo``: id → (original, moved)) is reused."""
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        key = id(value)
        if key not in memo or memo[key][1].device != device:
            memo[key] = (value, value.to(device, non_blocking=False))  # the original is kept: its id stays unique
        return memo[key][1]
    if isinstance(value, tuple | list):
        return type(value)(move(v, device, memo) for v in value)
    if isinstance(value, dict):
        return {k: move(v, device, memo) for k, v in value.items()}
    return value


def check_stages(stages: Sequence[Stage], layers: int) -> None:
    """Raise ValueError unless ``stages`` cover layers ``0..layers-1`` in order, each with at least one layer."""
    expected = 0
    for device, start, stop in stages:
        if start != expected or stop <= start:
            raise ValueError(f"pipeline stages {list(stages)} do not cover the {layers} decoder layers in order "
                             f"(stage on {device} starts at {start}, expected {expected})")
        expected = stop
    if expected != layers:
        raise ValueError(f"pipeline stages {list(stages)} end at layer {expected}, the model has {layers}")


def place_pipeline(model: nn.Module, text_model: nn.Module, stages: Sequence[Stage], keep: set[int]
                   ) -> list[torch.utils.hooks.RemovableHandle]:
    """Place ``model`` over the ``stages`` (module docstring); the submodules in ``keep`` (ids: host embeddings)
    stay where they are. Returns the hooks' handles."""
    layers = text_model.layers
    check_stages(stages, len(layers))
    devices = [torch.device(device) for device, _, _ in stages]
    to_device_except(model, devices[0], keep | {id(layers), id(text_model.norm)})
    text_model.norm.to(devices[-1])
    memo: dict[int, tuple[Any, Any]] = {}
    handles = [text_model.register_forward_pre_hook(lambda module, args: memo.clear()),
               text_model.register_forward_hook(lambda module, args, output: memo.clear())]
    # Every layer after the first stage gets a mover, also where two stages share a device (cpu,cpu runs this
    # path on one CPU, as tests do): a tensor already on the device is passed through untouched.
    for stage, (device, (_, start, stop)) in enumerate(zip(devices, stages, strict=True)):
        for index in range(start, stop):
            layers[index].to(device)
            if stage:
                handles.append(layers[index].register_forward_pre_hook(_mover(device, memo), with_kwargs=True))
    handles.append(text_model.norm.register_forward_pre_hook(_mover(devices[-1], memo), with_kwargs=True))
    log.info("pipeline split: %s", "; ".join(f"layers {a}-{b - 1} on {d}" for d, a, b in stages))
    return handles


def _mover(device: torch.device, memo: dict[int, tuple[Any, Any]]) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return move(args, device, memo), move(kwargs, device, memo)
    return hook


def limit_cuda_memory(device: str, cap: int) -> float:
    """Cap torch's CUDA allocator on ``device`` so that the process uses at most ``cap`` bytes there, CUDA context
    and other processes' use included (``torch.cuda.set_per_process_memory_fraction``); return the fraction set."""
    index = torch.device(device).index or 0
    free, total = torch.cuda.mem_get_info(index)
    outside = total - free - torch.cuda.memory_reserved(index)  # the context and whatever else holds memory there
    fraction = max(0.0, min(1.0, (cap - outside) / total))
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    log.info("%s: allocator capped at %.2f GiB (%.3f of %.1f GiB; %.2f GiB held outside it)", device,
             fraction * total / (1 << 30), fraction, total / (1 << 30), outside / (1 << 30))
    return fraction
