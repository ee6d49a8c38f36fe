"""The context export validation loads its models at: what its longest probe needs, not the model's default.

A decision pass's activations grow with its tokens, and a model streamed from disk runs each layer over the whole
batch (it cannot cut a prefill into chunks), so the context decides whether a capped machine can validate at all:
Clef-flash streamed under ``--max-memory cpu=6GiB`` fits about 14K tokens, not the 64K it publishes nor the 16K the
loader falls back to. The probes are tokenized first (the release's tokenizer, a second or two) and the models are
planned at the longest one (rounded up; the model's own context at most: a longer state is truncated as the
reference truncates it). When that does not fit, the probe set is cut before its first probe that does not, logged
with what would run it whole; the verdict is then reached on that prefix (validation.json records how many probes
were left out and why), or refused before anything is written when the prefix is too short to ever pass.
docs/quantization.md#validation.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clef_local.errors import InsufficientMemoryError

if TYPE_CHECKING:
    from clef_local.formats.release import Release
    from clef_local.planning.choice import LoadDecision

log = logging.getLogger(__name__)

ROUND = 256  # contexts are planned in steps of 256 tokens: near-equal probe sets share a plan (and a cache key)
# a request's images and videos are not tokenized here (that needs the processor and the decoded media): each one
# counts this many tokens more, as much as the packaged probes' small images take with room to spare
MEDIA_TOKENS = 2048


@dataclass(frozen=True)
class ProbeFit:
    """The probes validation will run and the load plan that runs them: ``requests`` (a prefix of those asked for;
    ``left_out`` more did not fit), ``context`` the tokens both models load at, ``decision`` the reference's plan
    (None: not planned, a reference file answers for it)."""

    requests: list[dict[str, Any]]
    context: int
    decision: LoadDecision | None
    # the tokens a state is truncated to: the model's own context (no probe in ``requests`` is longer than
    # ``context`` unless it is longer than this too): what the answers depend on, so the reference cache's key
    truncation: int
    left_out: int = 0
    reason: str | None = None  # why probes were left out


def request_tokens(release: Release, requests: Sequence[Mapping[str, Any]]) -> list[int]:
    """How many tokens each request encodes into with ``release``'s tokenizer (text; :data:`MEDIA_TOKENS` per
    image or video on top)."""
    from clef_local.runtime.encoding import encode_request
    from clef_local.runtime.schema import validate_request
    from clef_local.runtime.tokenizer import ReleaseTokenizer

    tokenizer = ReleaseTokenizer(release.path)
    counts = []
    for request in requests:
        validated = validate_request(request)
        media = len(validated.images or ()) + len(validated.videos or ())
        record = encode_request(tokenizer, validated, max_length=1 << 30)
        counts.append(len(record.input_ids) + MEDIA_TOKENS * media)
    return counts


def _rounded(tokens: int) -> int:
    return -(-tokens // ROUND) * ROUND


def fit_probes(release: Release, requests: list[dict[str, Any]], *, dtype: str | None, max_memory: str | None,
               plan_reference: bool = True) -> ProbeFit:
    """The probes and context validation runs at on this machine (:mod:`this module's docstring
    <clef_local.export.validation_context>`); :class:`~clef_local.errors.InsufficientMemoryError` when not even the
    first probe fits. ``plan_reference`` False: the reference's answers come from a file, so only the context is
    chosen here (the variant is planned by the caller)."""
    from clef_local.backends.loader import plan_backend
    from clef_local.planning.load_options import LoadOptions
    from clef_local.runtime.encoding import default_max_length

    lengths = request_tokens(release, requests)
    ceiling = default_max_length(release.max_position_embeddings)
    needs = [min(_rounded(n), ceiling) for n in lengths]
    context = max(needs, default=ROUND)
    if not plan_reference:
        return ProbeFit(requests, context, None, ceiling)

    def plan(tokens: int) -> LoadDecision:
        return plan_backend(release, LoadOptions(dtype=dtype, max_memory=max_memory, offload="auto",
                                                 max_length=tokens))

    try:
        return ProbeFit(requests, context, plan(context), ceiling)
    except InsufficientMemoryError as whole:
        first_error = whole
    # fitting is monotone in the context: the longest needed length that fits, by bisection over the needed ones
    shorter, decision = 0, None
    candidates = sorted({n for n in needs if n < context})
    low, high = 0, len(candidates) - 1
    while low <= high:
        mid = (low + high) // 2
        try:
            decision, shorter = plan(candidates[mid]), candidates[mid]
            low = mid + 1
        except InsufficientMemoryError:
            high = mid - 1
    if decision is None:
        raise first_error
    cut = next(i for i, n in enumerate(needs) if n > shorter)
    reason = (f"probe {cut + 1} on needs more than the {shorter:,} tokens the reference fits here "
              f"(the longest, {max(lengths):,} tokens: {first_error})")
    log.warning("validation runs on the first %d of %d probes: %s; a higher --max-memory runs them all",
                cut, len(requests), reason)
    return ProbeFit(requests[:cut], shorter, decision, ceiling, left_out=len(requests) - cut, reason=reason)
