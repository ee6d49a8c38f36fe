"""The validation of ``clef-local export-gguf``, like every variant's (:mod:`clef_local.export.validate`): the probe
set through the BF16 reference (or its cached answers) and through the GGUF on llama.cpp (``--backend llamacpp``,
chosen by the loader for a GGUF release), the sequential verdict on the bounds of KL and flips against the limits of
the clef-local scheme of the same precision (:data:`LIMITS_OF`), ``validation.json`` in the release.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_local.quant import registry

if TYPE_CHECKING:
    from clef_local.export.validate import ValidationInputs
    from clef_local.formats.release import Release

# A GGUF type is held to the limits (and the most probes) of clef-local's scheme of its precision: 8 bits and more
# as int8 (KL 0.002, 1% flips), the 4-6 bit k-quants and IQ4_XS as int4. The float types are held to int8's: they
# should pass it at once, and a converter bug would not.
LIMITS_OF = {"F32": "int8", "F16": "int8", "BF16": "int8", "Q8_0": "int8",
             "Q6_K": "int4", "Q5_K_M": "int4", "Q4_K_M": "int4", "IQ4_XS": "int4"}


def limits_scheme(qtype: str) -> str:
    """The clef-local scheme whose limits and probe count ``qtype`` is validated against."""
    return LIMITS_OF[qtype]


def default_probes(qtype: str) -> int:
    """The most probes the sequential verdict may use for ``qtype`` (its :func:`limits_scheme`'s)."""
    return registry.get(limits_scheme(qtype)).validation_requests


def check(release: Release, qtype: str, probes: int, *, max_memory: str | None = None,
          max_length: int | None = None) -> ValidationInputs:
    """Before anything is written: that validation can run (the probe set, the reference's memory, enough probes to
    ever pass), :class:`~clef_local.export.validation_errors.ValidationUnavailable` naming why not. The GGUF is not
    planned here: llama.cpp maps its file, and a GGUF is smaller than the reference this plans."""
    from clef_local.export.validate import THRESHOLDS, check_validation

    return check_validation(release, probes, limits=THRESHOLDS[limits_scheme(qtype)], max_memory=max_memory,
                            max_length=max_length)


def validate_gguf(release: Release, staged: Path, qtype: str, checked: ValidationInputs, *, out: Path,
                  max_memory: str | None = None, max_length: int | None = None) -> dict[str, Any]:
    """Validate the GGUF release staged at ``staged`` against ``release``: the record ``validation.json`` holds, or
    :class:`~clef_local.export.validation_errors.ValidationRefused` (failed or undecided) carrying it."""
    from clef_local.export.validate import THRESHOLDS, validate_export

    scheme = limits_scheme(qtype)
    return validate_export(release, staged, scheme, len(checked.requests), variant_name=out,
                           thresholds=THRESHOLDS[scheme], max_memory=max_memory, max_length=max_length,
                           checked=checked, label=f"the {qtype} GGUF (held to {scheme}'s limits)")
