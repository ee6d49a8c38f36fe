"""How export validation ends when it does not pass: refused (failed or undecided, with what it measured) or unable to
run. Apart from :mod:`clef_local.export.validate` so that the modules it calls (the probe set's reader) raise them
without importing it back.
"""

from __future__ import annotations

from typing import Any

from clef_local.errors import ClefError


class ValidationRefused(ClefError):
    """Validation ran and did not pass: the export is refused. ``result`` holds what ``validation.json`` holds
    (written into the staging directory before this is raised; None when nothing was measured, e.g. the variant did
    not load), which the export keeps beside ``--out`` (:mod:`clef_local.export.refusal`)."""

    def __init__(self, message: str, result: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.result = result


class ValidationFailed(ValidationRefused):
    """The variant's decisions moved more than the scheme's thresholds allow (or the variant did not load)."""


class ValidationUndecided(ValidationRefused):
    """The probe set was used up before validation reached a verdict either way: the export is refused. Neither a
    pass nor a failure can be claimed at the stated error; the message says what would decide it."""


class ValidationUnavailable(ClefError):
    """Validation cannot run here (no probe set, not enough memory, the reference does not load): the export is
    refused rather than written unvalidated; ``--no-validate`` is the explicit way to do that."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"validation cannot run: {reason}; the variant was not written (pass --no-validate to write "
                         f"it unvalidated: config.json and validation.json then say so)")
