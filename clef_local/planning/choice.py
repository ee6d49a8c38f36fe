"""Choosing the backend, device, dtype and kernel that run a release's backbone, and checking that it fits: a pure
function of the hardware (:mod:`clef_local.planning.hardware`), the scheme, the planner's footprint and the installed
backends, :func:`plan_load` for one device and :func:`plan_split` for several (docs/hardware.md#the-loader). The
backends are only names here; :mod:`clef_local.backends.loader` builds them.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from clef_local.errors import ApiUsageError, InsufficientMemoryError
from clef_local.planning.census import WeightCensus
from clef_local.planning.estimate import DTYPE_SIZE, Plan, auto_state_cache, best_fit, max_context, plan
from clef_local.planning.hardware import Hardware
from clef_local.planning.load_options import DEFAULT_OPTIONS, LoadOptions
from clef_local.planning.prefill import CHUNKED_PREFILL_BACKENDS
from clef_local.planning.read_probe import ReadRate
from clef_local.planning.split import SplitPlan, split_plan
from clef_local.planning.stream import OFFLOAD_MODES, StreamDecision, StreamPlan, stream_plan
from clef_local.quant import registry
from clef_local.units import GiB

log = logging.getLogger(__name__)

# name -> (module, class); modules are imported only when chosen, so a torch-free install never imports torch.
BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("clef_local.backends.torch_backend", "TorchBackend"),
    "mlx": ("clef_local.backends.mlx_backend", "MLXBackend"),
    "onnx": ("clef_local.backends.onnx_backend", "OnnxBackend"),
    "llamacpp": ("clef_local.backends.llamacpp_backend", "LlamaCppBackend"),
}
PACKAGES = {"torch": ("torch", "pip install torch"), "mlx": ("mlx", "pip install 'clef-local[mlx]'"),
            "onnx": ("onnxruntime", "pip install 'clef-local[onnx]'"),
            "llamacpp": ("llama_cpp", "pip install 'clef-local[gguf]'")}
DENSE = "dense"
PER_LAYER = "per_layer"  # a mixed-precision variant: its layers' schemes choose (clef_local.backends.quantized)
DEQUANTIZE = registry.DEQUANTIZE  # clef_local.backends.quantized.DEQUANTIZE: W rebuilt per call, never cached
# (backend, device kind) -> scheme -> kernel, from the schemes' rows; the torch names are
# clef_local.backends.quantized's, MLX's clef_local.backends.mlx_backend's (its CPU build dequantizes and matmuls)
KERNELS: dict[tuple[str, str], dict[str, str]] = {
    device: {name: row.kernels[device] for name, row in registry.SCHEMES.items()}
    for device in dict.fromkeys(device for row in registry.SCHEMES.values() for device in row.kernels)
}
# a mixed variant on MLX: its quantized layers run MLX's quantized kernel, whichever scheme (int4, int8)
_MLX_MIXED = registry.names_where(lambda row: row.mlx_quantized)[0]
# the backends that can continue a pass from a cached state (Backend.state_cache_blocker); the others run every state
STATE_CACHE_BACKENDS = ("torch",)
# the state cache when no plan was made (check_memory=False): a fixed, small budget
UNPLANNED_STATE_CACHE = 256 << 20
# BF16 bytes of a quantized linear over its stored bytes, for the schemes MLX dequantizes at load
DEQUANTIZED_GROWTH = {name: row.dequantized_growth for name, row in registry.SCHEMES.items() if not row.mlx_quantized}


@dataclass(frozen=True)
class LoadDecision:
    """What the loader chose and why; ``ClefModel.describe()`` shows it under ``"loader"``."""

    backend: str
    device: str
    dtype: str
    scheme: str  # "bf16" for a full-precision release
    kernel: str  # the quantized layers' kernel (torch: the name quantized.py records per layer)
    reason: str
    need_bytes: int | None = None
    available_bytes: int | None = None
    split: tuple[tuple[str, int, int], ...] = ()  # (device, first layer, end layer) per pipeline stage
    state_cache_bytes: int = 0  # the state cache's budget on the device (0: off)
    context: int | None = None  # the tokens per record the plan was made at
    # activation bytes one prefill may use beside the weights, runtime, margin and state cache (None: no plan);
    # clef_local.planning.prefill sizes each batch's chunks and refuses a request with it
    activation_room: int | None = None
    stream: StreamDecision | None = None  # streamed from disk (clef_local.planning.stream); None: resident

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def installed_backends() -> dict[str, str | None]:
    """{backend: None if usable here, else why not (with the install command)}; imports nothing heavy."""
    out: dict[str, str | None] = {}
    for name, (package, install) in PACKAGES.items():
        module = BACKENDS[name][0]
        if not importable(package):
            out[name] = f"{package} is not installed ({install})"
        elif not importable(module):
            out[name] = f"{module} is not part of this clef-local"
        else:
            out[name] = None
    return out


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def onnx_cuda() -> bool:
    """Whether ONNX Runtime here has its CUDA execution provider (onnxruntime-gpu)."""
    if not importable("onnxruntime"):
        return False
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def default_dtype(hardware: Hardware, backend: str) -> tuple[str, str]:
    """(compute dtype, why) for ``backend`` on ``hardware`` when none is asked for."""
    if hardware.kind == "cuda":
        if hardware.bf16:
            return "bfloat16", f"bf16 on {hardware.capability_label or 'CUDA'}"
        return "float16", f"{hardware.capability_label} has no fast bf16"
    if hardware.kind == "apple" and backend == "mlx":
        return "bfloat16", "bf16 on Apple silicon"
    if backend == "mlx":
        return "float32", "MLX's Linux CPU build is slow in bf16 (docs/hardware.md, known traps)"
    speed = hardware.bf16_speedup
    if hardware.fast_bf16:
        return "bfloat16", (f"bf16 measured {speed:.2f}x float32's speed on this CPU" if speed is not None
                            else "bf16 is faster than float32 on this CPU")
    if speed is not None:
        return "float32", f"bf16 measured {speed:.2f}x float32's speed on this CPU: not faster, float32 is exact-er"
    return "float32", "bf16's speed is not measured on this CPU (the probe needs torch): float32"


def kernel_for(backend: str, hardware: Hardware, scheme: str, *, bitsandbytes: bool,
               dtype: str = "bfloat16") -> str:
    """The kernel the quantized layers of ``scheme`` run on (``dense`` for a full-precision release)."""
    if scheme == "bf16":
        return DENSE
    kind = "cpu" if backend == "onnx" else hardware.kind
    if scheme == "mixed":  # each layer's module picks its own scheme's kernel at load; MLX runs int4 and int8 alike
        return KERNELS[(backend, kind)][_MLX_MIXED] if backend == "mlx" else PER_LAYER
    kernel = KERNELS[(backend, kind)][scheme]
    row = registry.get(scheme)
    if backend == "torch" and kind in ("cpu", "apple") and row.half_precision_cpu_kernel and dtype == "float32":
        return DEQUANTIZE  # torch's int4/int8 CPU kernels are slower than dequantizing with float32 activations
    if backend == "torch" and hardware.kind == "cuda":
        met = {registry.NEEDS_FP8: hardware.fp8,  # torch._scaled_mm needs sm_89+
               registry.NEEDS_SM80: (hardware.compute_capability or (0, 0)) >= (8, 0),  # tinygemm: sm_80+
               registry.NEEDS_BF16: dtype == "bfloat16"}  # tinygemm: bfloat16 activations
        if not all(met[need] for need in row.cuda_needs):
            return DEQUANTIZE
        if row.no_bitsandbytes_kernel and not bitsandbytes:
            return row.no_bitsandbytes_kernel  # int8: torch._int_mm (clef_local.backends.quantized)
    return kernel


def choose(hardware: Hardware, scheme: str, *, backend: str = "auto", dtype: Any = None,
           installed: Mapping[str, str | None], onnx_export: bool = False, bitsandbytes: bool = True,
           onnx_cuda: bool = False) -> LoadDecision:
    """The backend, device, dtype and kernel for ``scheme`` on ``hardware`` (no memory check); pure.
    ``onnx_cuda``: ONNX Runtime offers its CUDA provider (onnxruntime-gpu), so ONNX runs on a CUDA card."""
    if backend not in ("auto", *BACKENDS):
        raise ApiUsageError(f"unknown backend {backend!r}; choose one of auto, {', '.join(BACKENDS)}")
    usable = [name for name, why in installed.items() if why is None]
    if backend == "llamacpp":  # planned apart, from the GGUF's tensor table (clef_local.planning.gguf_plan)
        raise ApiUsageError("backend 'llamacpp' runs a GGUF backbone (gguf/model.gguf) on one device: write one with "
                            "`clef-local export-gguf` and load that directory; it does not split or stream")
    if backend != "auto":
        if installed.get(backend) is not None:
            raise ApiUsageError(f"backend {backend!r} is not available here: {installed[backend]}; available: "
                                f"{', '.join(usable) or 'none'}")
        name, reason = backend, f"backend={backend} was asked for"
    elif hardware.kind == "cuda":
        name, reason = "torch", f"CUDA ({hardware.name}) runs through torch"
    elif hardware.kind == "apple" and "mlx" in usable:
        name, reason = "mlx", "Apple silicon runs through MLX"
    elif onnx_export and "onnx" in usable:
        name, reason = "onnx", "the directory holds an ONNX export (onnx/) and onnxruntime is installed"
    else:
        name = "torch"
        reason = ("Apple silicon without mlx: torch on the CPU (pip install 'clef-local[mlx]' for MLX)"
                  if hardware.kind == "apple" else "a CPU runs through torch"
                  + (f" (an ONNX export is here, but {installed.get('onnx')})" if onnx_export else ""))
    if name == "torch" and installed.get("torch") is not None:
        raise ApiUsageError(f"no backend for this machine: {installed['torch']}; available: {', '.join(usable)}")
    if name == "torch" and scheme in registry.SCHEMES and registry.get(scheme).needs_bitsandbytes and not bitsandbytes:
        raise ApiUsageError(f"{scheme} variants run through bitsandbytes on torch: pip install 'clef-local[cuda]' "
                            "(bitsandbytes), or load an int4 variant")
    onnx_on_cpu = name == "onnx" and not (onnx_cuda and hardware.kind == "cuda")
    device = "cpu" if onnx_on_cpu or (hardware.kind == "apple" and name == "torch") else hardware.device
    dtype = None if dtype in (None, "auto") else str(dtype).removeprefix("torch.")  # a torch.dtype works too
    if dtype is not None and dtype not in DTYPE_SIZE:
        raise ApiUsageError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_SIZE)} or auto")
    if dtype is None:
        dtype, why = default_dtype(as_cpu(hardware) if onnx_on_cpu else hardware, name)
    else:
        why = "dtype was asked for"
    kernel = kernel_for(name, hardware, scheme, bitsandbytes=bitsandbytes, dtype=dtype)
    if name == "mlx" and scheme in DEQUANTIZED_GROWTH:
        reason += f"; {scheme} is dequantized at load on MLX (more memory than the stored variant)"
    return LoadDecision(backend=name, device=device, dtype=dtype, scheme=scheme, kernel=kernel,
                        reason=f"{reason}; {dtype}: {why}")


def as_cpu(hardware: Hardware) -> Hardware:
    """The host CPU of ``hardware`` (a backend that runs there: ONNX Runtime, torch on a Mac without MLX)."""
    if hardware.kind == "cpu":
        return hardware
    return replace(hardware, kind="cpu", device="cpu", fast_bf16=False, total_bytes=hardware.host_total_bytes,
                   free_bytes=hardware.host_free_bytes, compute_capability=None, fp8=False, unified_memory=False)


def resident_census(census: WeightCensus, backend: str) -> WeightCensus:
    """The weights as the backend holds them: MLX dequantizes nf4/fp8 at load (to bf16)."""
    if backend == "mlx" and census.fmt in DEQUANTIZED_GROWTH:
        return replace(census, quantized_linears=int(census.quantized_linears * DEQUANTIZED_GROWTH[census.fmt]))
    return census


def plan_load(hardware: Hardware, scheme: str, footprint: Any, *, context: int,
              options: LoadOptions = DEFAULT_OPTIONS, installed: Mapping[str, str | None], onnx_export: bool = False,
              bitsandbytes: bool = True, source: str = "DIR", onnx_cuda: bool = False,
              read_rate: ReadRate | None = None) -> LoadDecision:
    """:func:`choose`, then the planner's check: raises :class:`InsufficientMemoryError` (with a suggestion) when
    the stored format does not fit at ``context`` tokens. ``footprint`` is a
    :class:`clef_local.planning.planner.Footprint` (``censuses`` per format, ``dims``); ``source`` names the
    directory in the suggestion. Of ``options``: ``backend``, ``dtype``, ``check_memory``; ``state_cache``, the
    state cache's budget in bytes, counted in the need (``None``: sized from what the plan leaves free,
    :func:`~clef_local.planning.estimate.auto_state_cache`; always 0 on a backend outside
    :data:`STATE_CACHE_BACKENDS`); ``offload``: ``"none"`` holds the backbone resident, ``"auto"`` streams it from
    disk when it does not fit resident, ``"disk"`` always streams it (:func:`streamed_decision`; ``read_rate`` only
    estimates the time a pass reads). Pure."""
    backend, dtype, state_cache, offload = options.backend, options.dtype, options.state_cache, options.offload
    if state_cache is not None and state_cache < 0:
        raise ApiUsageError(f"the state cache size cannot be negative, got {state_cache}; 0 turns it off")
    if offload not in OFFLOAD_MODES:
        raise ApiUsageError(f"offload must be one of {', '.join(OFFLOAD_MODES)}, not {offload!r}")
    decision = choose(hardware, scheme, backend=backend, dtype=dtype, installed=installed, onnx_export=onnx_export,
                      bitsandbytes=bitsandbytes, onnx_cuda=onnx_cuda)
    cache = state_cache if decision.backend in STATE_CACHE_BACKENDS else 0
    if not options.check_memory or footprint is None:
        if offload == "disk":
            raise ApiUsageError("streaming from disk is planned from the release's headers; it cannot run with the "
                                "memory check off")
        return replace(decision, state_cache_bytes=UNPLANNED_STATE_CACHE if cache is None else cache)
    target = hardware if decision.device != "cpu" or hardware.kind == "cpu" else as_cpu(hardware)
    plans = {fmt: resident_plan(c, footprint, target, decision, context) for fmt, c in footprint.censuses.items()}
    mine = plans[scheme]
    if offload == "disk" or (offload == "auto" and not mine.fits):
        return streamed_decision(hardware, decision, scheme, footprint, context=context, options=options,
                                 installed=installed, bitsandbytes=bitsandbytes, read_rate=read_rate,
                                 resident=mine, source=source)
    if not mine.fits:
        message = refusal(mine, plans, footprint, target, decision, context, source)
        streamed = _streamed_hint(hardware, decision, scheme, footprint, context, dtype, installed, bitsandbytes)
        raise InsufficientMemoryError(message + (f"; or stream it from disk: --offload disk, offload=\"disk\" "
                                                 f"({streamed.decision().summary()})" if streamed else ""))
    asked = cache is not None
    if cache is None:
        cache = auto_state_cache(mine, footprint.dims)  # fits by construction
    if cache:
        with_cache = resident_plan(footprint.censuses[scheme], footprint, target, decision, context, cache)
        if asked and not with_cache.fits:
            room = max(0, mine.available - mine.need - (with_cache.state_cache - cache))
            raise InsufficientMemoryError(
                f"{mine.fmt} on {decision.backend} fits at {context:,} tokens, but not with a state cache of "
                f"{cache / GiB:.2f} GiB: it needs {with_cache.need / GiB:.1f} GiB, {mine.available / GiB:.1f} GiB "
                f"free on {target.device}; ask for at most {room / GiB:.2f} GiB (state_cache=, --state-cache) "
                f"or 0 (off)")
        mine = with_cache
    return replace(decision, need_bytes=mine.need, available_bytes=mine.available, state_cache_bytes=cache,
                   context=context, activation_room=mine.activation_room)


def resident_plan(census: WeightCensus, footprint: Any, hardware: Hardware, decision: LoadDecision,
                  context: int, state_cache: int = 0) -> Plan:
    """The plan of ``census`` as ``decision``'s backend holds it on ``hardware`` at ``context`` tokens, with a state
    cache of ``state_cache`` bytes."""
    return plan(resident_census(census, decision.backend), footprint.dims, hardware, context=context,
                dtype=decision.dtype, host_embeddings=_host_embeddings(decision), media=decision.backend == "torch",
                state_cache=state_cache, chunking=decision.backend in CHUNKED_PREFILL_BACKENDS)


def _torch_for_stream(hardware: Hardware, decision: LoadDecision, scheme: str, *, backend: str, dtype: Any,
                      installed: Mapping[str, str | None], bitsandbytes: bool) -> LoadDecision:
    """``decision`` on the torch backend, the one that streams: ``auto`` moves MLX / ONNX Runtime to torch (on a
    Mac: torch on the CPU); a backend asked for by name is refused."""
    if decision.backend == "torch":
        return decision
    if backend != "auto":
        raise ApiUsageError(f"streaming from disk runs on the torch backend, not {decision.backend}; drop --backend "
                            f"{backend} (backend=) or the offload")
    moved = choose(hardware, scheme, backend="torch", dtype=dtype, installed=installed, bitsandbytes=bitsandbytes)
    return replace(moved, reason=f"{moved.reason}; torch, because only it streams from disk")


def streamed_plan(hardware: Hardware, decision: LoadDecision, scheme: str, footprint: Any, *, context: int,
                  read_rate: ReadRate | None = None) -> StreamPlan:
    """The streamed plan of ``scheme`` as ``decision``'s torch backend would run it on ``hardware``."""
    target = hardware if decision.device != "cpu" or hardware.kind == "cpu" else as_cpu(hardware)
    return stream_plan(footprint.censuses[scheme], footprint.dims, target, context=context, dtype=decision.dtype,
                       read_rate=read_rate)


def streamed_decision(hardware: Hardware, decision: LoadDecision, scheme: str, footprint: Any, *, context: int,
                      options: LoadOptions, installed: Mapping[str, str | None], bitsandbytes: bool,
                      read_rate: ReadRate | None, resident: Plan, source: str) -> LoadDecision:
    """``decision`` streamed from disk (:mod:`clef_local.planning.stream`), or :class:`InsufficientMemoryError`
    when not even that fits. The state cache is off: a streamed pass cannot keep its layers' states cheaply."""
    if why_not := footprint.censuses[scheme].unstreamable:
        if resident.fits:
            raise ApiUsageError(f"{source} cannot be streamed from disk: {why_not}; load it without offload")
        raise InsufficientMemoryError(
            f"{scheme} does not fit on {hardware.device} ({hardware.name}): it needs {resident.need / GiB:.1f} GiB at "
            f"{context:,} tokens, {resident.available / GiB:.1f} GiB free, and {source} cannot be streamed from "
            f"disk ({why_not}); try a shorter max_length, more memory or a higher --max-memory")
    torch_decision = _torch_for_stream(hardware, decision, scheme, backend=options.backend, dtype=options.dtype,
                                       installed=installed, bitsandbytes=bitsandbytes)
    sp = streamed_plan(hardware, torch_decision, scheme, footprint, context=context, read_rate=read_rate)
    if not sp.fits:
        raise InsufficientMemoryError(
            f"{scheme} does not fit on {sp.hardware.device} ({sp.hardware.name}) even streamed from disk: it needs "
            f"{sp.need / GiB:.1f} GiB at {context:,} tokens ({sp.resident / GiB:.1f} resident + "
            f"{sp.groups / GiB:.2f} for two groups of {sp.group_layers} layer(s) + {sp.activations.total / GiB:.1f} of "
            f"activations + overhead), {sp.available / GiB:.1f} GiB free; try a shorter max_length, more memory or a "
            f"higher --max-memory (clef-local plan --model {source} shows the terms)")
    why = ("asked for (offload=disk)" if resident.fits
           else f"resident it needs {resident.need / GiB:.1f} GiB, {resident.available / GiB:.1f} GiB free")
    stream = sp.decision()
    # the streamed pass runs each layer over the whole batch at once (no chunks): its activations get what the
    # streamed weights leave
    room = sp.available - (sp.need - sp.activations.total)
    return replace(torch_decision, need_bytes=sp.need, available_bytes=sp.available, state_cache_bytes=0,
                   stream=stream, context=context, activation_room=room,
                   reason=f"{torch_decision.reason}; streamed from disk: {why}")


def _streamed_hint(hardware: Hardware, decision: LoadDecision, scheme: str, footprint: Any, context: int,
                   dtype: Any, installed: Mapping[str, str | None], bitsandbytes: bool) -> StreamPlan | None:
    """The streamed plan a refusal offers (None when streaming cannot run here or does not fit either)."""
    if footprint.censuses[scheme].unstreamable:
        return None
    try:
        torch_decision = _torch_for_stream(hardware, decision, scheme, backend="auto", dtype=dtype,
                                           installed=installed, bitsandbytes=bitsandbytes)
    except ApiUsageError:
        return None
    sp = streamed_plan(hardware, torch_decision, scheme, footprint, context=context)
    return sp if sp.fits else None


def plan_split(devices: list[Hardware], scheme: str, footprint: Any, *, context: int,
               options: LoadOptions = DEFAULT_OPTIONS, installed: Mapping[str, str | None], bitsandbytes: bool = True,
               source: str = "DIR") -> LoadDecision:
    """:func:`choose` for the first device (``options``' backend and dtype), then the pipeline split of the stored
    format over ``devices`` (:mod:`clef_local.planning.split`, by the footprint's per-layer bytes); raises
    :class:`InsufficientMemoryError` when a device's stage does not fit (``options.check_memory``). Torch only.
    Pure."""
    decision = choose(devices[0], scheme, backend=options.backend, dtype=options.dtype, installed=installed,
                      bitsandbytes=bitsandbytes)
    if decision.backend != "torch":
        raise ApiUsageError(f"a split over several devices runs on the torch backend, not {decision.backend}; "
                            "drop --backend or give one device")
    splits = {fmt: resident_split(c, footprint, devices, decision, context) for fmt, c in footprint.censuses.items()}
    mine = splits[scheme]
    decision = replace(decision, device=",".join(h.device for h in devices), split=mine.ranges,
                       need_bytes=sum(s.need for s in mine.stages),
                       available_bytes=sum(s.available for s in mine.stages),
                       reason=f"{decision.reason}; layers split over {len(devices)} devices by their bytes")
    if options.check_memory and not mine.fits:
        raise InsufficientMemoryError(split_refusal(mine, splits, source))
    return decision


def resident_split(census: WeightCensus, footprint: Any, devices: list[Hardware], decision: LoadDecision,
                   context: int) -> SplitPlan:
    """The split of ``census`` as the torch backend holds it (host embeddings on CUDA, the vision tower loaded)."""
    return split_plan(census, footprint.dims, devices, context=context, dtype=decision.dtype,
                      host_embeddings=devices[0].kind == "cuda", media=True)


def split_refusal(mine: SplitPlan, splits: Mapping[str, SplitPlan], source: str) -> str:
    """"int8 split over cuda:0, cuda:1 needs 25.1 + 25.6 GiB at 16,384 tokens, 24.0 + 24.0 GiB free; try ..."."""
    head = (f"{mine.fmt} split over {', '.join(s.hardware.device for s in mine.stages)} needs "
            f"{' + '.join(f'{s.need / GiB:.1f}' for s in mine.stages)} GiB at {mine.context:,} tokens, "
            f"{' + '.join(f'{s.available / GiB:.1f}' for s in mine.stages)} GiB free")
    smaller = next((sp for fmt, sp in splits.items() if fmt != mine.fmt and sp.fits), None)
    if smaller is not None:
        return (f"{head}; try {_BITS_FLAG[smaller.fmt]}: clef-local quantize {_BITS_FLAG[smaller.fmt]} --model "
                f"{source} --out {source}-{smaller.fmt}")
    return f"{head}; try a 4-bit variant, a shorter max_length, more devices or larger --max-memory caps"


def _host_embeddings(decision: LoadDecision) -> bool:
    """Torch on CUDA keeps ``embed_tokens``/``lm_head`` in host memory (TorchBackbone); other backends do not."""
    return decision.backend == "torch" and decision.device.startswith("cuda")


_BITS_FLAG = {name: row.flag for name, row in registry.SCHEMES.items()}


def refusal(mine: Plan, plans: Mapping[str, Plan], footprint: Any, hardware: Hardware, decision: LoadDecision,
            context: int, source: str) -> str:
    """"needs 17.2 GiB, 11.0 GiB free on cuda:0; try --bits 4 (...)": the numbers and what to do instead."""
    head = (f"{mine.fmt} on {decision.backend} needs {mine.need / GiB:.1f} GiB at {context:,} tokens, "
            f"{mine.available / GiB:.1f} GiB free on {hardware.device} ({hardware.name})")
    smaller = best_fit({f: p for f, p in plans.items() if f != mine.fmt})
    if smaller is not None:
        return (f"{head}; try {_BITS_FLAG[smaller.fmt]}: clef-local quantize {_BITS_FLAG[smaller.fmt]} --model "
                f"{source} --out {source}-{smaller.fmt} (needs {smaller.need / GiB:.1f} GiB)")
    census = resident_census(mine.census, decision.backend)
    longest = max_context(census, footprint.dims, hardware, dtype=decision.dtype,
                          host_embeddings=_host_embeddings(decision),
                          media=decision.backend == "torch", limit=context,
                          chunking=decision.backend in CHUNKED_PREFILL_BACKENDS)
    hints = []
    eight_bit = mine.fmt == "bf16" or (mine.fmt in registry.SCHEMES and registry.get(mine.fmt).bits > 4)
    if eight_bit and mine.fmt == footprint.stored:
        hints.append("a 4-bit variant of the source (clef-local quantize --bits 4)")
    if longest:
        hints.append(f"max_length={longest} (a context of {longest:,} tokens fits)")
    hints.append("a device with more memory (clef-local plan --device ... shows which)")
    if hardware.cap_bytes is not None:
        hints.append(f"a higher --max-memory for {hardware.device} (capped at {hardware.cap_bytes / GiB:.1f} GiB)")
    return f"{head}; try " + ", or ".join(hints)
