"""Building the backend that runs a release's backbone: :mod:`clef_local.planning.choice` decides, this builds.

Backends implement :class:`clef_local.backends.base.Backend`; their modules are imported only when chosen, so a
torch-free install never imports torch.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from clef_local.backends.base import Backend
from clef_local.errors import ApiUsageError, InsufficientMemoryError
from clef_local.formats.release import Release
from clef_local.planning.caps import cap_for, parse_max_memory, resolve_devices, with_cap
from clef_local.planning.choice import (
    BACKENDS,
    LoadDecision,
    importable,
    installed_backends,
    onnx_cuda,
    plan_load,
    plan_split,
)
from clef_local.planning.hardware import Hardware
from clef_local.planning.load_options import DEFAULT_OPTIONS, LoadOptions
from clef_local.units import GiB

log = logging.getLogger(__name__)


def plan_backend(release: Release, options: LoadOptions = DEFAULT_OPTIONS, *, fmt: str | None = None
                 ) -> LoadDecision:
    """What :func:`build_backend` would build for ``release`` with ``options``, and whether it fits, without loading
    a tensor. ``fmt``: plan another format of a BF16 release (a variant not written yet: export validation checks it
    before quantizing); default the stored one. A streamed decision carries this disk's read rate
    (:mod:`clef_local.planning.read_probe`, measured once and cached)."""
    from clef_local.planning.census import stored_format
    from clef_local.planning.hardware import detect
    from clef_local.planning.planner import footprint_from_release
    from clef_local.runtime.encoding import REFERENCE_MAX_LENGTH, default_max_length

    backend, device, offload = options.backend, options.device, options.offload
    try:
        caps = parse_max_memory(options.max_memory)
        # a CPU: is bf16 faster here? measured once (planning.dtype_probe), cached in the user cache
        devices = resolve_devices(device, caps, functools.partial(detect, measure_bf16=True))
    except ValueError as exc:
        raise ApiUsageError(str(exc)) from exc
    hardware = devices[0]
    if backend == "llamacpp" or (release.is_gguf and fmt is None):  # a GGUF backbone runs on llama.cpp only
        return _plan_gguf(release, options, devices)
    scheme = fmt or stored_format(release.config)
    split = len(devices) > 1
    if split and offload == "disk":
        raise ApiUsageError(f"streaming from disk runs on one device, not {device}; give one device or drop the "
                            "offload")
    footprint = footprint_from_release(release) if options.check_memory or split or offload != "none" else None
    if footprint is not None and scheme not in footprint.censuses:
        raise ApiUsageError(f"{release.path} is a {footprint.stored} variant; it cannot be planned as {scheme}")
    context, min_context = options.max_length, None
    if context is None:  # no length asked for: the published context, falling back to the reference's
        context = default_max_length(release.max_position_embeddings)
        min_context = min(REFERENCE_MAX_LENGTH, context)
    onnx_export = (Path(release.path) / "onnx").is_dir()
    kwargs: dict[str, Any] = dict(options=options, installed=installed_backends(),
                                  bitsandbytes=importable("bitsandbytes"), source=str(release.path))

    def decide(tokens: int) -> LoadDecision:
        if split:
            return plan_split(devices, scheme, footprint, context=tokens, **kwargs)
        try:
            return plan_load(hardware, scheme, footprint, context=tokens, onnx_export=onnx_export,
                             onnx_cuda=hardware.kind == "cuda" and (backend == "onnx" or onnx_export) and onnx_cuda(),
                             **kwargs)
        except InsufficientMemoryError:
            cards = _other_cards(hardware, caps) if device == "auto" and backend in ("auto", "torch") else []
            if not cards:
                raise
            log.info("the model does not fit on %s alone: split over %d cards", hardware.device, len(cards) + 1)
            return plan_split([hardware, *cards], scheme, footprint, context=tokens, **kwargs)

    try:
        decision = decide(context)
    except InsufficientMemoryError as exc:
        if min_context is None or min_context >= context:
            raise
        decision = decide(min_context)  # raises when not even min_context tokens fit
        log.warning("%s; planned at %s tokens instead: longer requests are refused one by one (413) when their "
                    "pass does not fit (max_length= asks for a context and refuses the load when it does not fit)",
                    exc, f"{min_context:,}")
    if decision.stream is not None and release.weight_files:
        from clef_local.planning.read_probe import read_rate

        largest = max(release.weight_files, key=lambda f: f.stat().st_size)
        rate = read_rate(largest)
        decision = replace(decision, stream=replace(decision.stream, read_rate=rate.bytes_per_second,
                                                    read_rate_source=rate.source))
    return decision


def _plan_gguf(release: Release, options: LoadOptions, devices: list[Hardware]) -> LoadDecision:
    from clef_local.planning.gguf_plan import plan_gguf_load

    if len(devices) > 1 or options.offload == "disk":
        raise ApiUsageError("llama.cpp runs a GGUF on one device, resident (it maps the file): give one device and "
                            "no --offload disk")
    return plan_gguf_load(release, options, devices[0], installed=installed_backends())


def build_backend(release: Release, options: LoadOptions = DEFAULT_OPTIONS) -> Backend:
    """The backend for ``release``: chosen by :func:`clef_local.planning.choice.plan_load` for this machine
    (``options.device``: ``auto``, ``cpu``, ``cuda[:N]``, ``mps``, or several for a pipeline split of the layers:
    ``cuda:0,cuda:1``), checked against the planner at ``options.max_length`` tokens (None: the model's default,
    65,536 at most; when that does not fit, planned at 16,384 instead, a warning: longer requests are refused one
    by one, 413) under the ``max_memory`` caps (``{"cuda:0": "24GiB"}`` or ``"cuda:0=24GiB"``,
    :mod:`clef_local.planning.caps`; on CUDA the allocator is capped too) with a state cache of ``state_cache``
    bytes (``None``: sized by the planner), logged, and recorded as ``backend.load_decision``
    (``state_cache_bytes``: the cache's budget). ``auto`` on a machine with several CUDA cards splits the layers
    over all of them when the model does not fit on the first one alone. ``offload``: ``"none"`` (resident only),
    ``"auto"`` (streamed from disk when it does not fit resident) or ``"disk"`` (always streamed;
    docs/hardware.md#streamed-from-disk). ``backend.prefill`` is the budget each prefill is cut to
    (:mod:`clef_local.planning.prefill`; ``prefill_chunk`` forces a chunk length, 0 one pass). A variant that export
    validation refused and ``quantize --quarantine`` kept is refused (:class:`~clef_local.errors.ReleaseError`,
    :func:`clef_local.formats.variant.check_not_quarantined`)."""
    from clef_local.formats.variant import check_not_quarantined
    from clef_local.planning.prefill import prefill_budget

    # every run of a model comes here (load, decide, serve, ui, mcp, batch, drift, eval, probe): a variant that
    # export validation refused and --quarantine kept is refused here, once, for all of them
    check_not_quarantined(release.path, release.config)
    decision = plan_backend(release, options)
    caps = parse_max_memory(options.max_memory)  # valid: plan_backend read it
    state_cache, dtype = options.state_cache, options.dtype
    _log_decision(decision)
    if state_cache is not None and state_cache > 0 and decision.state_cache_bytes == 0:
        log.warning("state cache: off: the %s backend%s runs every state in full (docs/serving.md)",
                    decision.backend, " with a split over devices" if decision.split
                    else " streamed from disk" if decision.stream else "")
    if caps and decision.backend == "torch":
        _cap_cuda(decision, caps)
    module_name, class_name = BACKENDS[decision.backend]
    cls = getattr(importlib.import_module(module_name), class_name)
    # an ONNX export runs in the precision it was exported in unless a dtype was asked for
    asked = dtype not in (None, "auto")
    placement: dict[str, Any] = {"split": decision.split} if decision.split else {}
    if decision.stream is not None:
        placement["stream"] = decision.stream
    forced_chunk = options.prefill_chunk
    if decision.backend == "llamacpp":  # llama.cpp sizes its context (KV cache) and decode chunk when it is made
        placement["context"] = decision.context
        placement["chunk"] = decision.context if forced_chunk == 0 else forced_chunk
        forced_chunk = None  # its chunks are its own: the torch prefill budget does not cut them
    runner: Backend = cls(release, device=decision.device,
                          dtype=decision.dtype if decision.backend != "onnx" or asked else None, **placement)
    runner.load_decision = decision
    runner.prefill = prefill_budget(decision, release.config, release.head_config.width, forced_chunk)
    return runner


def _log_decision(decision: LoadDecision) -> None:
    log.info("backend %s on %s, %s, %s kernel: %s%s%s", decision.backend, decision.device, decision.dtype,
             decision.kernel, decision.reason,
             f" (needs {decision.need_bytes / GiB:.2f} of {decision.available_bytes / GiB:.1f} GiB)"
             if decision.need_bytes is not None and decision.available_bytes is not None else "",
             f"; {decision.stream.summary()}" if decision.stream is not None else "")


def _other_cards(first: Hardware, caps: dict[str, int]) -> list[Hardware]:
    """The CUDA cards after ``first`` (capped), for ``auto``'s split; none on a machine with one card."""
    if first.kind != "cuda":
        return []
    import torch

    from clef_local.planning.hardware import detect_cuda

    found = [detect_cuda(i) for i in range(1, torch.cuda.device_count())]
    return [with_cap(h, cap_for(caps, h.device)) for h in found if h is not None]


def _cap_cuda(decision: LoadDecision, caps: dict[str, int]) -> None:
    """Cap the allocator of every CUDA device the decision uses that has a cap (the whole device's cap, also when
    it is listed several times)."""
    from clef_local.backends.placement import limit_cuda_memory

    for name in dict.fromkeys(decision.device.split(",")):
        cap = cap_for(caps, name)
        if name.startswith("cuda") and cap is not None:
            limit_cuda_memory(name, cap)
