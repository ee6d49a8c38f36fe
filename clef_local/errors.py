"""Errors raised by clef-local.

Every error a caller can cause carries the HTTP status and the SystemOne ``error_type`` it maps to, so the
server turns it into a response without guessing, and the CLI prints one clear line instead of a traceback.
"""

from __future__ import annotations

from typing import Any


def one_line(text: object) -> str:
    """A message on one line (transformers' and pydantic's span several): the CLI prints one line per error."""
    return " ".join(str(text).split())


def short(text: str, limit: int = 40) -> str:
    """``text`` cut for a message: an error must not echo a megabyte back."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ClefError(Exception):
    """Base class of every error clef-local raises on purpose."""

    status_code: int = 400
    error_type: str = "api_usage_error"

    def to_detail(self) -> Any:
        """The ``detail`` member of the HTTP error body (docs/serving.md)."""
        return {"error_type": self.error_type, "message": str(self)}


class RequestValidationError(ClefError, ValueError):
    """A request that does not match the SystemOne schema (HTTP 422).

    ``errors`` is a list of ``{"loc": [...], "msg": str, "type": str}``, the FastAPI/pydantic shape, with
    ``loc`` starting at the body (``["body", "questions", "q1", "criteria"]``).
    """

    status_code = 422
    error_type = "validation_error"

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        self.errors = errors
        lines = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors]
        super().__init__("invalid request: " + "; ".join(lines))

    def to_detail(self) -> Any:
        return self.errors


class ApiUsageError(ClefError, ValueError):
    """A well-formed request that asks for something this server does not allow (HTTP 400)."""


class LimitExceededError(ApiUsageError):
    """Too many questions, options or levels for the configured limits (HTTP 400)."""


class MaxTokensExceededError(ClefError, ValueError):
    """State plus schema do not fit the model's context (HTTP 413, ``max_tokens_exceeded``)."""

    status_code = 413
    error_type = "max_tokens_exceeded"

    def __init__(self, message: str, *, input_tokens: int, max_tokens: int) -> None:
        self.input_tokens = input_tokens
        self.max_tokens = max_tokens
        super().__init__(message)


class RequestMemoryError(MaxTokensExceededError):
    """A request within the context whose backbone pass the memory left after the weights cannot hold (HTTP 413,
    ``max_tokens_exceeded``, like every request too long for where it runs). ``max_tokens`` is the longest request
    that fits there; ``need_bytes`` and ``budget_bytes`` are the pass's activations and the memory left for them."""

    def __init__(self, message: str, *, input_tokens: int, max_tokens: int, need_bytes: int,
                 budget_bytes: int) -> None:
        self.need_bytes = need_bytes
        self.budget_bytes = budget_bytes
        super().__init__(message, input_tokens=input_tokens, max_tokens=max_tokens)


class ReleaseError(ClefError):
    """A release directory that is missing files, has unknown config keys or mis-shaped tensors."""

    status_code = 500
    error_type = "release_error"


class NetworkBlockedError(ClefError, ConnectionRefusedError):
    """A connection to a non-loopback address while clef-local runs air-gapped (pass --allow-network to permit)."""

    status_code = 500
    error_type = "network_blocked"


class InsufficientMemoryError(ClefError):
    """A release that the planner says does not fit the device; the message says what to try instead."""

    status_code = 500
    error_type = "insufficient_memory"


class BatchError(ClefError):
    """A ``clef-local batch`` job that cannot run as asked: an input it cannot read, a journal written for another
    model or schema, a Ray cluster too small for the replicas (the message names the value and the fix)."""
