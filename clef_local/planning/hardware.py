"""What this machine can run on (docs/hardware.md): a CUDA GPU, Apple silicon, or the CPU. :func:`detect` never fails
on a missing package; :func:`named_device` describes machines that are not this one (``rtx4090``, ``mac-36``,
``"24GiB"``) so the planner can answer "would it fit there?"; :func:`thread_plan` sizes inference threads so that they
never oversubscribe the cores (docs/hardware.md#threads).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from clef_local import units
from clef_local.errors import ApiUsageError
from clef_local.units import GiB, MiB

log = logging.getLogger(__name__)

Kind = Literal["cuda", "apple", "cpu"]
# macOS lets Metal wire about this share of unified memory by default (raise it with
# `sudo sysctl iogpu.wired_limit_mb=...`); MLX reports the exact value as max_recommended_working_set_size.
APPLE_GPU_SHARE_SMALL, APPLE_GPU_SHARE_LARGE = 2 / 3, 3 / 4


@dataclass(frozen=True)
class Hardware:
    """One compute device and the host around it.

    ``total_bytes``/``free_bytes`` are the device's memory (CUDA: the GPU's; Apple: the unified memory Metal may use;
    CPU: RAM and MemAvailable). ``bf16`` says BF16 math is supported at all (from the flags); ``fast_bf16`` that it
    is faster than float32: CUDA sm_80+ and Apple by their generation, a CPU by measurement only
    (:mod:`clef_local.planning.dtype_probe`; ``bf16_speedup`` is float32's time over BF16's there, None when not
    measured, and then ``fast_bf16`` is False).
    """

    kind: Kind
    name: str
    device: str  # "cuda:0", "mps", "cpu"
    total_bytes: int
    free_bytes: int
    compute_capability: tuple[int, int] | None = None
    bf16: bool = False
    fast_bf16: bool = False
    fp8: bool = False  # FP8 matmul (torch._scaled_mm): CUDA sm_89+
    cores: int | None = None
    host_total_bytes: int = 0  # RAM beside the device (equal to the device's memory on CPU and Apple)
    host_free_bytes: int = 0
    unified_memory: bool = False
    bf16_speedup: float | None = None  # CPU: measured float32 time / BF16 time (dtype_probe); None: not measured
    cpu_flags: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    cap_bytes: int | None = None  # a --max-memory cap (clef_local.planning.caps): free_bytes is at most this

    @property
    def shares_host_memory(self) -> bool:
        """True when device and host memory are the same pool (CPU, Apple unified memory)."""
        return self.kind != "cuda"

    @property
    def capability_label(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}" if self.compute_capability else ""

    def summary(self) -> str:
        """One line: name, memory, capability."""
        extra = [self.capability_label] if self.compute_capability else []
        if self.kind == "cpu":
            extra.append(f"{self.cores} cores" if self.cores else "")
        if self.kind == "cpu" and self.bf16_speedup is not None:
            extra.append(f"bf16 measured {self.bf16_speedup:.2f}x float32's speed"
                         + (" (auto runs bf16)" if self.fast_bf16 else " (auto runs float32)"))
        elif self.kind == "cpu":
            extra.append("bf16 speed not measured" + ("" if self.bf16 else "; no bf16 flags"))
        else:
            extra.append("bf16 " + ("fast" if self.fast_bf16 else "supported" if self.bf16 else "unsupported"))
        if self.fp8:
            extra.append("fp8")
        return (f"{self.kind} {self.device}: {self.name}, {self.total_bytes / GiB:.1f} GiB"
                f" ({self.free_bytes / GiB:.1f} GiB free); " + ", ".join(e for e in extra if e))

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        out["cpu_flags"] = list(self.cpu_flags)
        out["notes"] = list(self.notes)
        return out


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or a broken __spec__
        return False


def host_memory() -> tuple[int, int]:
    """(total, available) RAM in bytes, from psutil: on Linux MemTotal/MemAvailable, on macOS the free and inactive
    pages (before: macOS reported free = total, having no ``SC_AVPHYS_PAGES``), on Windows the OS's
    available physical memory."""
    import psutil

    memory = psutil.virtual_memory()
    return int(memory.total), int(memory.available)


def cpu_flags_and_name() -> tuple[tuple[str, ...], str]:
    """The CPU's feature flags (x86 ``flags`` / arm ``Features``) and model name from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return (), platform.processor() or platform.machine()
    flags: set[str] = set()
    name = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("flags", "Features"):
            flags.update(value.split())
        elif key in ("model name", "Model name") and not name:
            name = value.strip()
    return tuple(sorted(flags)), name or platform.processor() or platform.machine()


def cpu_bf16(flags: tuple[str, ...] | set[str]) -> bool:
    """Whether the CPU's flags show BF16 instructions (AVX512-BF16, AMX-BF16, ARM BF16). Whether BF16 is *faster*
    than float32 is measured, not read from here (:mod:`clef_local.planning.dtype_probe`)."""
    return bool({"amx_bf16", "avx512_bf16", "bf16"} & set(flags))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def detect_cpu(measure_bf16: bool = False) -> Hardware:
    """The CPU: cores (usable by this process), RAM, BF16 support from its flags, and BF16's measured speed: the
    cached measurement of :mod:`clef_local.planning.dtype_probe`, or with ``measure_bf16`` a new one when none is
    cached (about a second, once per CPU and torch version; needs torch)."""
    from clef_local.planning.dtype_probe import bf16_probe, cached_probe

    flags, name = cpu_flags_and_name()
    bf16 = cpu_bf16(flags)
    total, free = host_memory()
    probe = bf16_probe(name, flags) if measure_bf16 else cached_probe(name, flags)
    if probe is not None:
        notes: tuple[str, ...] = (probe.summary(),)
    else:
        notes = ("bf16 speed not measured yet (clef-local doctor measures it; needs torch): auto runs float32",)
    keep = tuple(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8",
                                           "bf16", "asimd", "sve", "i8mm"))
    return Hardware(kind="cpu", name=name, device="cpu", total_bytes=total, free_bytes=free, bf16=bf16,
                    fast_bf16=probe is not None and probe.bf16_faster, cores=_cores(), host_total_bytes=total,
                    host_free_bytes=free, bf16_speedup=probe.speedup if probe is not None else None,
                    cpu_flags=keep, notes=notes)


def detect_cuda(index: int = 0) -> Hardware | None:
    """CUDA device ``index`` through torch, or None without torch or CUDA."""
    if not _available("torch"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    capability = (props.major, props.minor)
    host_total, host_free = host_memory()
    return Hardware(kind="cuda", name=props.name, device=f"cuda:{index}", total_bytes=int(total),
                    free_bytes=int(free), compute_capability=capability, bf16=capability >= (8, 0),
                    fast_bf16=capability >= (8, 0), fp8=capability >= (8, 9), cores=_cores(),
                    host_total_bytes=host_total, host_free_bytes=host_free)


def detect_apple() -> Hardware | None:
    """Apple silicon (Darwin + arm64 + mlx importable) with its unified memory, or None."""
    if platform.system() != "Darwin" or platform.machine() != "arm64" or not _available("mlx"):
        return None
    import mlx.core as mx

    info_fn = getattr(mx, "device_info", None) or mx.metal.device_info
    info = dict(info_fn())
    total = int(info.get("memory_size") or host_memory()[0])
    usable = int(info.get("max_recommended_working_set_size") or total * APPLE_GPU_SHARE_LARGE)
    return Hardware(kind="apple", name=str(info.get("device_name", "Apple silicon")), device="mps",
                    total_bytes=usable, free_bytes=usable, bf16=True, fast_bf16=True, cores=_cores(),
                    host_total_bytes=total, host_free_bytes=host_memory()[1], unified_memory=True,
                    notes=(f"Metal may use {usable / GiB:.1f} of {total / GiB:.1f} GiB unified memory",))


def detect(device: str = "auto", *, measure_bf16: bool = False) -> Hardware:
    """The hardware ``device`` names (``auto``: CUDA, else Apple silicon, else CPU; ``cpu``; ``cuda``/``cuda:N``;
    ``mps``). Raises ValueError when the named kind is not present. ``measure_bf16``: a CPU without a cached BF16
    measurement is measured now (:func:`detect_cpu`)."""
    if device == "cpu":
        return detect_cpu(measure_bf16)
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        found = detect_cuda(index)
        if found is None:
            raise ValueError(f"device {device!r}: no CUDA GPU visible to torch here; use --device cpu or auto")
        return found
    if device in ("mps", "apple", "metal"):
        found = detect_apple()
        if found is None:
            raise ValueError(f"device {device!r}: not Apple silicon with mlx installed; use --device cpu or auto")
        return found
    if device != "auto":
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps")
    return detect_cuda() or detect_apple() or detect_cpu(measure_bf16)


# name: (label, memory MiB as the driver reports it, compute capability)
CUDA_CARDS: dict[str, tuple[str, int, tuple[int, int]]] = {
    "rtx3090": ("NVIDIA GeForce RTX 3090", 24576, (8, 6)),
    "rtx4090": ("NVIDIA GeForce RTX 4090", 24564, (8, 9)),
    "rtx5090": ("NVIDIA GeForce RTX 5090", 32607, (12, 0)),
    "l4": ("NVIDIA L4", 23034, (8, 9)),
    "a6000": ("NVIDIA RTX A6000", 49140, (8, 6)),
    "rtx6000-ada": ("NVIDIA RTX 6000 Ada Generation", 49140, (8, 9)),
    "l40s": ("NVIDIA L40S", 46068, (8, 9)),
    "a100-40g": ("NVIDIA A100-SXM4-40GB", 40960, (8, 0)),
    "a100-80g": ("NVIDIA A100-SXM4-80GB", 81920, (8, 0)),
    "h100": ("NVIDIA H100 80GB HBM3", 81559, (9, 0)),
    "h200": ("NVIDIA H200", 143771, (9, 0)),
}
_MAC = re.compile(r"^mac-(?P<n>\d+)$", re.IGNORECASE)
_CPU = re.compile(r"^cpu-(?P<n>\d+)g?$", re.IGNORECASE)


def apple_gpu_share(total_gib: float) -> float:
    """macOS's default Metal working-set share of unified memory (about 2/3 below 36 GiB, 3/4 from 36 GiB)."""
    return APPLE_GPU_SHARE_LARGE if total_gib >= 36 else APPLE_GPU_SHARE_SMALL


def named_device(name: str) -> Hardware:
    """A device that need not be this machine: a card (``rtx4090``, ``l40s``, ``a100-80g``, ``h100``, ``h200``, ...),
    a size with its unit (``"24GiB"``, ``"24GB"``: a CUDA card of that many bytes, :mod:`clef_local.units`),
    ``mac-36`` (Apple silicon with 36 GiB) or ``cpu-8`` (8 GiB of RAM).

    Its memory is all free; the host beside a card is assumed to hold at least the card's size again."""
    key = name.strip().lower()
    if key in CUDA_CARDS:
        label, mib, capability = CUDA_CARDS[key]
        return _card(label, mib * MiB, capability)
    if (match := units.SIZE.match(key)) and match["unit"]:
        size = units.parse_size(name.strip(), what="the device size")
        return _card(f"a {match['n']} {match['unit'].upper().replace('I', 'i')} CUDA card", size, None)
    if match := _MAC.match(key):
        total = int(match["n"]) * GiB
        usable = int(total * apple_gpu_share(int(match["n"])))
        return Hardware(kind="apple", name=f"Mac with {match['n']} GiB unified memory", device="mps",
                        total_bytes=usable, free_bytes=usable, bf16=True, fast_bf16=True, host_total_bytes=total,
                        host_free_bytes=total, unified_memory=True,
                        notes=(f"Metal's default working set: {usable / GiB:.1f} of {total / GiB:.0f} GiB",))
    if match := _CPU.match(key):
        total = int(match["n"]) * GiB
        return Hardware(kind="cpu", name=f"CPU with {match['n']} GiB RAM", device="cpu", total_bytes=total,
                        free_bytes=total, host_total_bytes=total, host_free_bytes=total)
    known = ", ".join([*CUDA_CARDS, "NNGiB", "mac-NN", "cpu-NN"])
    raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda, mps or a named device: {known}")


def _card(label: str, size: int, capability: tuple[int, int] | None) -> Hardware:
    cap = capability or (0, 0)
    return Hardware(kind="cuda", name=label, device="cuda:0", total_bytes=size, free_bytes=size,
                    compute_capability=capability, bf16=capability is None or cap >= (8, 0),
                    fast_bf16=capability is None or cap >= (8, 0), fp8=cap >= (8, 9), host_total_bytes=2 * size,
                    host_free_bytes=2 * size)


def resolve_device(device: str) -> Hardware:
    """:func:`detect` for ``auto``/``cpu``/``cuda[:N]``/``mps``, :func:`named_device` for anything else."""
    if device in ("auto", "cpu", "mps") or re.fullmatch(r"cuda(:\d+)?", device):
        return detect(device)
    return named_device(device)


# ------------------------------------------------------------------------------------------------------ threads
THREADS_ENV = "CLEF_LOCAL_THREADS"
OMP_ENV = "OMP_NUM_THREADS"
Role = Literal["command", "server"]
ROLES: tuple[Role, ...] = ("command", "server")
# Cores left to everything that is not the forward. The server keeps one for its event loop, HTTP parsing and JSON,
# the OS and whatever else shares the machine: an OpenMP forward waits at every barrier for its slowest thread, so
# one thread that shares its core with other work stalls all of them (docs/hardware.md#threads,
# docs/benchmarks.md#threads). A one-shot command (decide, quantize, eval, ...) has nothing else to run while it
# computes, so it keeps none.
RESERVED_CORES: dict[Role, int] = {"command": 0, "server": 1}
# The role a thread_plan without one plans for: "server" (the library's default: a caller may be serving), or what
# the CLI set for its own process (use_process_threads).
_process_role: Role = "server"
# The OMP_NUM_THREADS value use_process_threads set from the rule: the rule's own, not a user's choice.
_rule_omp: str | None = None


def _cgroup_paths() -> dict[str, str]:
    """``{controller: path}`` of this process's cgroups (``""`` for the v2 unified hierarchy)."""
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                out[controller] = parts[2]
    return out


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup"), paths: Mapping[str, str] | None = None) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (``cpu.max`` of cgroup v2 or ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us`` of v1, the tightest along the path up to the root), or None when there is none."""
    paths = _cgroup_paths() if paths is None else paths
    hierarchies = ((root, "", _cpu_max), (root / "cpu", "cpu", _cfs_quota), (root / "cpu,cpuacct", "cpu", _cfs_quota))
    limits = []
    for base, controller, read in hierarchies:
        if controller not in paths or not base.is_dir():
            continue
        here = base / paths[controller].lstrip("/")
        for directory in (here, *here.parents):
            if directory == base.parent:
                break
            if (quota := read(directory)) is not None:
                limits.append(quota)
    return min(limits) if limits else None


def _cpu_max(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _cfs_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def physical_cores(cpus: Iterable[int] | None = None, sysfs: Path = Path("/sys/devices/system/cpu"),
                   quota: float | None = None) -> int:
    """Physical cores this process may run on: the distinct (package, core) pairs of the CPUs in its affinity mask
    (hyper-threads of one core count once; a CPU without topology files counts as a core), capped by the cgroup
    CPU quota (``quota``, default :func:`cgroup_cpu_limit`; a container limited to 2.5 CPUs gets 2). Outside Linux:
    the logical CPU count."""
    if cpus is None:
        try:
            cpus = os.sched_getaffinity(0)
        except AttributeError:  # macOS, Windows
            return os.cpu_count() or 1
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    count = max(len(cores), 1)
    quota = cgroup_cpu_limit() if quota is None else quota
    return max(1, min(count, int(quota))) if quota else count


@dataclass(frozen=True)
class ThreadPlan:
    """Threads for inference: ``intra_op`` per forward (``torch.set_num_threads``, ONNX Runtime's
    ``intra_op_num_threads``) and ``inter_op`` (1: clef-local runs no parallel graph branches), for ``workers``
    inference threads on ``physical_cores`` cores in ``role`` (a one-shot ``command`` or a ``server``); ``source``
    says who chose ``intra_op``."""

    intra_op: int
    inter_op: int
    physical_cores: int
    workers: int
    source: Literal["rule", "argument", "CLEF_LOCAL_THREADS", "OMP_NUM_THREADS"]
    role: Role = "server"

    def describe(self) -> str:
        if self.role == "server":
            rule = (f"{self.physical_cores} physical core(s) − {RESERVED_CORES['server']} for the event loop and the "
                    "rest of the machine")
        else:
            rule = f"all {self.physical_cores} physical core(s): a one-shot command has no event loop to leave one to"
        why = {"rule": f"{rule}, over {self.workers} inference thread(s); set {THREADS_ENV} to override",
               "argument": "as asked", THREADS_ENV: f"from {THREADS_ENV}", OMP_ENV: f"from {OMP_ENV}"}
        return (f"{self.intra_op} intra-op thread(s) per inference thread, {self.inter_op} inter-op "
                f"({why[self.source]})")

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"summary": self.describe()}


def _threads_value(name: str, value: str) -> int:
    try:
        number = int(value.split(",")[0])  # OMP_NUM_THREADS may list nested levels: "4,2"
    except ValueError:
        number = 0
    if number < 1:
        raise ApiUsageError(f"{name}={value!r} is not a thread count; set it to a whole number ≥ 1 or unset it")
    return number


def thread_plan(workers: int = 1, threads: int | None = None, *, role: Role | None = None, cores: int | None = None,
                environ: Mapping[str, str] | None = None) -> ThreadPlan:
    """How many threads each of ``workers`` inference threads may use in ``role``. ``threads`` (an explicit setting,
    e.g. a ``--threads`` flag) wins, then ``$CLEF_LOCAL_THREADS``, then ``$OMP_NUM_THREADS`` (the user's choice for
    every OpenMP program), then the rule: ``(physical cores − RESERVED_CORES[role]) // workers``, at least 1 — every
    physical core for a one-shot ``command``, one fewer for a ``server`` (its event loop needs a core; measured
    under a competing load, docs/benchmarks.md#threads). ``role`` defaults to this process's
    (:func:`process_role`: ``server`` unless the CLI runs a one-shot command)."""
    if workers < 1:
        raise ApiUsageError(f"inference workers must be ≥ 1, got {workers}")
    role = _process_role if role is None else role
    if role not in ROLES:
        raise ApiUsageError(f"thread role must be one of {', '.join(ROLES)}, got {role!r}")
    environ = os.environ if environ is None else environ
    cores = physical_cores() if cores is None else cores
    if threads is not None:
        if threads < 1:
            raise ApiUsageError(f"threads must be ≥ 1, got {threads}")
        return ThreadPlan(threads, 1, cores, workers, "argument", role)
    for name in (THREADS_ENV, OMP_ENV):
        value = environ.get(name)
        if value and not (name == OMP_ENV and environ is os.environ and value == _rule_omp):
            return ThreadPlan(_threads_value(name, value), 1, cores, workers, name, role)  # type: ignore[arg-type]
    return ThreadPlan(max(1, (cores - RESERVED_CORES[role]) // workers), 1, cores, workers, "rule", role)


def process_role() -> Role:
    """The thread role of this process: ``server`` (the default) or what :func:`use_process_threads` set."""
    return _process_role


def use_process_threads(role: Role) -> ThreadPlan:
    """For ``clef-local COMMAND`` run as its own process, before torch is imported: every later :func:`thread_plan`
    of this process plans for ``role`` (ONNX Runtime sessions among them), and ``$OMP_NUM_THREADS`` is set to the
    plan's intra-op threads unless the user set it (torch and OpenMP read it once, when torch is imported). Returns
    the plan. Never call it in a process that must keep its own threads: tests, notebooks, an embedding app."""
    global _process_role, _rule_omp
    if role not in ROLES:
        raise ApiUsageError(f"thread role must be one of {', '.join(ROLES)}, got {role!r}")
    _process_role = role
    plan = thread_plan(role=role)
    if not os.environ.get(OMP_ENV):
        _rule_omp = os.environ[OMP_ENV] = str(plan.intra_op)
    return plan
