"""Device lists and memory caps: ``--device cuda:0,cuda:1`` and ``--max-memory cuda:0=24GiB``.

A cap makes a device's free memory ``min(free, cap)`` for the planner and the loader (on CUDA the allocator is capped
too: :func:`clef_local.backends.placement.limit_cuda_memory`); a device listed k times is shared, each entry getting
1/k of its capped free memory. docs/hardware.md#memory-caps.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace

from clef_local import units
from clef_local.planning.hardware import Hardware
from clef_local.units import GiB

ALL = "*"  # the key of a cap that applies to every device
_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")
CAP_HINT = ("write sizes like 24GiB, 24000MiB or 25.7GB, and devices like cuda:0 "
            "(--max-memory cuda:0=24GiB,cuda:1=24GiB)")


def parse_size(text: str) -> int:
    """Bytes of a memory cap (:func:`clef_local.units.parse_size`), which must be positive."""
    size = units.parse_size(text, what="the memory size")
    if size <= 0:
        raise ValueError(f"a memory size must be positive, not {text!r}")
    return size


def parse_max_memory(value: str | Mapping[str, str | int] | None) -> dict[str, int]:
    """``{device: bytes}`` from ``"cuda:0=24GiB,cuda:1=24GiB"``, from ``"24GiB"`` (every device: key ``*``) or from a
    mapping of the same (sizes as text or bytes)."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        items: list[tuple[str, str | int]] = []
        for part in value.split(","):
            name, sep, text = part.strip().rpartition("=")
            items.append((name.strip() if sep else ALL, text))
    else:
        items = list(value.items())
    caps: dict[str, int] = {}
    for device, size in items:
        if device != ALL and not _DEVICE.match(device):
            raise ValueError(f"--max-memory names an unknown device {device!r}; {CAP_HINT}")
        key = "cuda:0" if device == "cuda" else device
        if key in caps:
            raise ValueError(f"--max-memory gives {key} twice; give each device once")
        caps[key] = size if isinstance(size, int) else parse_size(size)
    return caps


def cap_for(caps: Mapping[str, int], device: str) -> int | None:
    """The cap of ``device`` (``cuda`` counts as ``cuda:0``), else the cap for every device, else None."""
    device = "cuda:0" if device == "cuda" else device
    return caps.get(device, caps.get(ALL))


def with_cap(hardware: Hardware, cap: int | None) -> Hardware:
    """``hardware`` with at most ``cap`` bytes (total and free; the name says so); unchanged without a cap."""
    if cap is None:
        return hardware
    return replace(hardware, total_bytes=min(hardware.total_bytes, cap), free_bytes=min(hardware.free_bytes, cap),
                   name=f"{hardware.name}, capped at {cap / GiB:.1f} GiB", cap_bytes=cap,
                   notes=(*hardware.notes, f"memory capped at {cap / GiB:.1f} GiB (--max-memory)"))


def split_devices(device: str) -> list[str]:
    """``"cuda:0,cuda:1"`` → ``["cuda:0", "cuda:1"]`` (one entry for a single device)."""
    names = [d.strip() for d in device.split(",")]
    if any(not d for d in names):
        raise ValueError(f"empty device name in {device!r}; write --device cuda:0,cuda:1")
    return names


def resolve_devices(device: str, caps: Mapping[str, int], resolve: Callable[[str], Hardware]) -> list[Hardware]:
    """The hardware of every entry of ``device`` (``resolve`` of one name: detection or a named device), each
    capped; a device listed k times is shared (each entry gets 1/k of its capped free memory, module docstring).
    Named devices of a list are numbered ``cuda:0``, ``cuda:1``, ... in order."""
    names = split_devices(device)
    found = [resolve(name) for name in names]
    if len(found) > 1 and len({h.kind for h in found}) > 1:
        kinds = ", ".join(h.kind for h in found)
        raise ValueError(f"--device {device}: a split needs devices of one kind, not {kinds}")
    if len(found) > 1 and found[0].kind == "cuda":  # named cards all call themselves cuda:0
        detected = [n for n in names if n.startswith("cuda")]
        if not detected:
            found = [replace(h, device=f"cuda:{i}") for i, h in enumerate(found)]
    found = [with_cap(h, cap_for(caps, h.device)) for h in found]
    shares = {h.device: sum(g.device == h.device for g in found) for h in found}
    return [h if shares[h.device] == 1 else replace(
        h, total_bytes=h.total_bytes // shares[h.device], free_bytes=h.free_bytes // shares[h.device],
        name=f"{h.name}, 1/{shares[h.device]} of it") for h in found]
