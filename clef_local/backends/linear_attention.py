"""Which implementation runs Qwen3.5's gated-delta-net (linear attention) layers, three of every four in Clef.

transformers picks, once at import, ``flash-linear-attention``'s kernel or a PyTorch loop over 64-token chunks, and
``causal-conv1d`` or ``F.conv1d``; the fallbacks are correct but much slower on a GPU. :func:`linear_attention_paths`
reads the choice for the load log and ``inspect`` (docs/hardware.md#the-gated-delta-nets-kernels).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

# what the layer calls → (the name in transformers' modeling module, the package that provides the fast path)
FUNCTIONS = {"chunk_gated_delta_rule": ("torch_chunk_gated_delta_rule", "flash-linear-attention"),
             "causal_conv1d": ("causal_conv1d_fn", "causal-conv1d")}
REFERENCE = "torch reference"


def linear_attention_paths(model_type: str = "qwen3_5") -> dict[str, str]:
    """``{function: "module.name" of the fast kernel, "torch reference", or "unknown (...)"}`` as transformers
    resolved them for ``model_type`` (reads the resolution transformers recorded; imports its modeling module)."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    paths = {}
    for name, (attribute, _) in FUNCTIONS.items():
        nonlocals = _resolution(getattr(module, attribute, None))
        implementation = nonlocals.get("implementation")
        if "is_new_implementation" not in nonlocals or implementation is None:
            paths[name] = f"unknown (transformers {_version()} does not record it as 5.x did)"
        elif nonlocals["is_new_implementation"]:
            paths[name] = f"{implementation.__module__}.{implementation.__name__}"
        else:
            paths[name] = REFERENCE
    return paths


def _resolution(function: Any) -> Mapping[str, Any]:
    """The closure in which transformers' ``use_kernel_func_from_hub_with_fallback`` recorded its choice, found
    through the wrappers around it (from 5.25 the function is a hub-kernel ``nn.Module`` whose ``forward`` closes
    over it); empty when none records it."""
    pending, seen = [function], 0
    while pending and seen < 8:
        candidate = pending.pop()
        seen += 1
        if candidate is None:
            continue
        try:
            nonlocals = inspect.getclosurevars(candidate).nonlocals
        except TypeError:  # not a Python function: look at a module's forward instead
            pending.append(getattr(type(candidate), "forward", None))
            continue
        if "is_new_implementation" in nonlocals:
            return nonlocals
        pending.extend(v for v in nonlocals.values() if inspect.isfunction(v))
        pending.append(getattr(candidate, "__wrapped__", None))
    return {}


def log_linear_attention_paths(device_type: str, model_type: str = "qwen3_5") -> dict[str, str]:
    """Log which implementations the gated-delta-net layers run (a warning for reference paths on CUDA, with the
    package to install); return :func:`linear_attention_paths`."""
    paths = linear_attention_paths(model_type)
    slow = [FUNCTIONS[name][1] for name, path in paths.items() if path == REFERENCE]
    text = "; ".join(f"{name}: {path}" for name, path in paths.items())
    if device_type == "cuda" and "flash-linear-attention" in slow:
        log.warning("gated delta net runs the reference PyTorch path on CUDA (%s): correct but much slower; "
                    "pip install 'clef-local[cuda]' brings flash-linear-attention", text)
    else:
        log.info("gated delta net: %s", text)
    return paths


def _version() -> str:
    import transformers

    return str(transformers.__version__)
