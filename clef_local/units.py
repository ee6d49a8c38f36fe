"""Sizes in bytes, read and written one way everywhere: ``--max-memory``, ``--state-cache``, named devices
(``--device 24GiB``) and what the logs print. ``KiB``…``TiB`` are binary, ``KB``…``TB`` decimal, a bare number is
bytes; anything else is refused with the forms that work (a bare ``2G`` is ambiguous, so it is refused too)."""

from __future__ import annotations

import re

from clef_local.errors import ApiUsageError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": KiB, "mib": MiB, "gib": GiB,
         "tib": TiB}
SIZE = re.compile(r"^\s*(?P<n>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[a-zA-Z]*)\s*$")
FORMS = "bytes, or a number with a unit: 512MiB, 24GiB (binary) or 25.7GB (decimal)"


def parse_size(value: str | int, *, what: str = "a size") -> int:
    """Bytes of ``value`` (``"24GiB"``, ``"25.7GB"``, ``"512 MiB"``, ``"1024"``, or an int); an
    :class:`~clef_local.errors.ApiUsageError` (a ``ValueError``) naming ``what``, the value and the forms."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ApiUsageError(f"{what} is {FORMS}; not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ApiUsageError(f"{what} cannot be negative, got {value}")
        return value
    match = SIZE.match(value)
    unit = match["unit"].lower() if match else ""
    if match is None or unit not in UNITS:
        raise ApiUsageError(f"cannot read {what} {value!r}: give {FORMS}")
    return int(float(match["n"]) * UNITS[unit])


def format_size(n: int) -> str:
    """``536870912`` → ``"512.0 MiB"``."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
