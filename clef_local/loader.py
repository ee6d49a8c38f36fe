"""Choosing and building the backend that runs a release's backbone (DESIGN §6).

Every backend class takes ``(release, *, device, dtype)`` and offers ``logits(records, layout, pad_token_id)`` (a
float32 ``[questions, max_options]`` array, the head included) and ``describe()``; :class:`clef_local.model.ClefModel`
does the rest (encoding, softmax, answers), so answers are built the same way on every backend.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from clef_local.errors import ApiUsageError
from clef_local.release import Release

log = logging.getLogger(__name__)

# name -> (module, class); modules are imported only when chosen, so a torch-free install never imports torch.
BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("clef_local.backends.torch_backend", "TorchBackend"),
    "mlx": ("clef_local.backends.mlx_backend", "MLXBackend"),
    "onnx": ("clef_local.backends.onnx_backend", "OnnxBackend"),
}


def build_backend(release: Release, *, backend: str = "auto", device: str = "auto", dtype: str | None = None) -> Any:
    """The backend object for ``release``; ``"auto"`` picks torch on the CPU."""
    name = "torch" if backend == "auto" else backend
    if name not in BACKENDS:
        raise ApiUsageError(f"unknown backend {backend!r}; choose one of auto, {', '.join(BACKENDS)}")
    if device == "auto":
        device = "cpu"
    module_name, class_name = BACKENDS[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    log.info("backend %s on %s", name, device)
    return cls(release, device=device, dtype=dtype)
