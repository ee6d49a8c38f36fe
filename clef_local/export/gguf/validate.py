"""The validation hook of ``clef-local export-gguf``: where a GGUF release is compared with its reference "like every
variant" (clef_local/export/validate.py: the probe set through the variant and through the BF16 reference, drift
against the scheme's thresholds, ``validation.json``).

That comparison runs the GGUF through the llama.cpp backend (``--backend llamacpp``), which is written on another
branch; until the two are merged this hook says so instead of pretending: an export without ``--no-validate`` is
refused before any work (:func:`require_validation`), and nothing here claims a check it did not run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clef_local.export.validation_errors import ValidationUnavailable

UNAVAILABLE = ("the llama.cpp backend (--backend llamacpp) that runs a GGUF against the reference is not in this "
               "build yet")


def require_validation(probes: int) -> None:
    """Refuse now (:class:`ValidationUnavailable`) when validation cannot run, before anything is written.
    WIRE HERE: once the llama.cpp backend is merged, check what ``validate_gguf`` needs (the probe set of
    ``probes`` requests, the reference's memory) like export-onnx's ``parity_requests``."""
    raise ValidationUnavailable(UNAVAILABLE)


def validate_gguf(release_dir: Path, *, probes: int) -> dict[str, Any]:
    """Validate the GGUF release staged at ``release_dir`` against its source: the result that ``validation.json``
    holds, or :class:`clef_local.export.validation_errors.ValidationRefused`. WIRE HERE (lead): run
    ``clef_local.export.validate`` with the llama.cpp backend on ``release_dir``."""
    raise ValidationUnavailable(UNAVAILABLE)
