"""Building the backend that runs a release's backbone: :mod:`clef_local.planning.choice` decides, this builds.

Backends implement :class:`clef_local.backends.base.Backend`; their modules are imported only when chosen, so a
torch-free install never imports torch.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

from clef_local.backends.base import Backend
from clef_local.errors import ApiUsageError
from clef_local.formats.release import Release
from clef_local.planning.choice import BACKENDS, decide, importable, installed_backends, onnx_cuda
from clef_local.planning.hardware import GiB

log = logging.getLogger(__name__)


def build_backend(release: Release, *, backend: str = "auto", device: str = "auto", dtype: Any = None,
                  context: int | None = None, check_memory: bool = True) -> Backend:
    """The backend for ``release``: chosen by :func:`clef_local.planning.choice.decide` for this machine
    (``device`` ``auto``, ``cpu``, ``cuda[:N]``, ``mps``), checked against the planner at ``context`` tokens
    (default: the model's context, at most 16,384), logged, and recorded as ``backend.load_decision``."""
    from clef_local.planning.census import stored_format
    from clef_local.planning.hardware import detect
    from clef_local.planning.planner import DEFAULT_CONTEXT, footprint_from_release

    try:
        hardware = detect(device, measure_bf16=True)  # a CPU: is bf16 faster here? measured once, cached
    except ValueError as exc:
        raise ApiUsageError(str(exc)) from exc
    scheme = stored_format(release.config)
    footprint = footprint_from_release(release.path) if check_memory else None
    context = context or min(DEFAULT_CONTEXT, release.max_position_embeddings or DEFAULT_CONTEXT)
    onnx_export = (Path(release.path) / "onnx").is_dir()
    decision = decide(hardware, scheme, footprint, context=context, backend=backend, dtype=dtype,
                      installed=installed_backends(), onnx_export=onnx_export,
                      bitsandbytes=importable("bitsandbytes"), check_memory=check_memory, source=str(release.path),
                      onnx_cuda=hardware.kind == "cuda" and (backend == "onnx" or onnx_export) and onnx_cuda())
    log.info("backend %s on %s, %s, %s kernel: %s%s", decision.backend, decision.device, decision.dtype,
             decision.kernel, decision.reason,
             f" (needs {decision.need_bytes / GiB:.2f} of {decision.available_bytes / GiB:.1f} GiB)"
             if decision.need_bytes is not None and decision.available_bytes is not None else "")
    module_name, class_name = BACKENDS[decision.backend]
    cls = getattr(importlib.import_module(module_name), class_name)
    # an ONNX export runs in the precision it was exported in unless a dtype was asked for
    asked = dtype not in (None, "auto")
    runner: Backend = cls(release, device=decision.device,
                          dtype=decision.dtype if decision.backend != "onnx" or asked else None)
    runner.load_decision = decision
    return runner
