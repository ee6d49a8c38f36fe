"""Quantization schemes as pure tensor functions: tensors in, tensors out; nothing else of clef_local imported."""

# Each scheme turns one 2-D weight [out, in] into a dict of tensors whose keys are relative to the module path
# (docs/quantization.md#the-rounding-rules-exactly); ``predicate.should_quantize`` decides which tensors are
# quantized. Importing the package imports no torch: ``predicate`` is pure Python (the planner uses it on torch-free
# installs), and the registry and the schemes load on first use.

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SCHEMES", "Scheme", "compressed", "fp8", "get", "int4", "int8", "nf4", "predicate"]

_SUBMODULES = ("compressed", "fp8", "int4", "int8", "nf4", "predicate")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in ("SCHEMES", "Scheme", "get"):
        return getattr(importlib.import_module(f"{__name__}.registry"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
