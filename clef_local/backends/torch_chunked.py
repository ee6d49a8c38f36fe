"""Chunked prefill on the torch backend: a long backbone pass run in chunks of N tokens, each chunk over a
``transformers`` cache that carries what the chunks before it left: the full-attention layers' keys and values and
the gated-delta-net layers' conv and recurrent states.

The output is still every position's final hidden state (the head reads all of them), but a layer's temporaries (MLP
intermediates, the attention of the chunk's queries, the gated delta rule's per-chunk tensors) are bounded by the
chunk, not the context. Chunks are cut at multiples of N counted from the first position, so a chunk boundary is
also one of the gated delta rule's own 64-token blocks (N is a multiple of 64) and the arithmetic is the one pass's
block for block. A record with images or videos runs its first chunk through the multimodal model
(:meth:`TorchBackbone.media_state <clef_local.backends.torch_backend.TorchBackbone.media_state>`: vision tower,
multimodal rope), extended to hold all its media, and the rest through the text model at the rope offset the media
left. The state cache's passes (:mod:`clef_local.backends.torch_cache`) run through the same loop. Memory and the
chunk length: docs/hardware.md#chunked-prefill; :mod:`clef_local.planning.prefill` picks N.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from clef_local.runtime.encoding import EncodedRecord


class Backbone(Protocol):
    """What the chunks need of :class:`clef_local.backends.torch_backend.TorchBackbone`."""

    device: torch.device
    text_model: Any

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, cache: Any = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor: ...

    def media_state(self, record: EncodedRecord, end: int, cache: Any) -> tuple[torch.Tensor, int]: ...


def new_cache(config: Any) -> Any:
    """An empty ``transformers`` ``DynamicCache`` laid out for ``config`` (one layer object per decoder layer)."""
    from transformers import DynamicCache

    return DynamicCache(config=config)


def chunk_bounds(start: int, end: int, chunk: int | None) -> list[tuple[int, int]]:
    """``[a, b)`` of each chunk of the positions ``start`` … ``end - 1``, cut at the multiples of ``chunk`` (None:
    one piece)."""
    if chunk is None or chunk < 1:
        return [(start, end)]
    bounds, a = [], start
    while a < end:
        b = min(end, (a // chunk + 1) * chunk)
        bounds.append((a, b))
        a = b
    return bounds


def chunk_positions(start: int, length: int, rows: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """Position ids of the tokens at ``start`` … ``start + length - 1`` for ``rows`` records: ``[rows, length]``
    token indices, or after media (``offset`` ≠ 0) Qwen3.5's ``[4, rows, length]``: the text row keeps the token
    index (what the text model gives a cache position), the three mrope rows (temporal, height, width) add the rope
    offset the media left: after the media, text positions are equal on every axis."""
    index = torch.arange(start, start + length, device=device).expand(rows, length)
    if offset == 0:
        return index
    rope = index + offset
    return torch.stack([index, rope, rope, rope])


@torch.inference_mode()
def run_chunks(backbone: Backbone, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: Any,
               chunk: int | None, *, past: int = 0, offset: int = 0) -> torch.Tensor:
    """Final hidden states ``[rows, T, hidden]`` of ``input_ids`` ``[rows, T]`` run after the ``past`` positions
    ``cache`` already holds (filled in place), in chunks of ``chunk`` tokens (None: one piece); ``attention_mask``
    ``[rows, past + T]`` covers the past and the new tokens; ``offset``: the rope offset after media."""
    rows, length = input_ids.shape
    if attention_mask.shape != (rows, past + length):
        raise ValueError(f"attention_mask is {tuple(attention_mask.shape)}, expected {(rows, past + length)}: "
                         "the past and the new tokens")
    out: torch.Tensor | None = None
    for a, b in chunk_bounds(past, past + length, chunk):
        positions = chunk_positions(a, b - a, rows, input_ids.device, offset)
        hidden = backbone.forward(input_ids[:, a - past:b - past], attention_mask[:, :b], cache=cache,
                                  position_ids=positions)
        if a == past and b == past + length:
            return hidden  # one piece: no copy
        if out is None:
            out = hidden.new_empty((rows, length, hidden.shape[-1]))
        out[:, a - past:b - past] = hidden
    if out is None:
        raise ValueError("run_chunks needs at least one token")
    return out


def media_chunks(backbone: Backbone, record: EncodedRecord, chunk: int | None, cache: Any,
                 end: int | None = None) -> tuple[torch.Tensor, int]:
    """One record with media, its first ``end`` positions (default: all), in chunks filling ``cache``: the final
    hidden states ``[end, hidden]`` and the rope offset after the media. The first chunk runs the multimodal model
    and ends at the first multiple of ``chunk`` past the media."""
    if record.media is None:
        raise ValueError("media_chunks needs a record with media; a text-only record runs run_chunks")
    end = len(record.input_ids) if end is None else end
    media_end = record.media.token_offset + len(record.media.token_ids)
    first = end if chunk is None else min(end, -(-max(media_end, 1) // chunk) * chunk)
    hidden, offset = backbone.media_state(record, first, cache)
    if first == end:
        return hidden, offset
    ids = torch.tensor([record.input_ids[first:end]], dtype=torch.long, device=backbone.device)
    mask = torch.ones((1, end), dtype=torch.long, device=backbone.device)
    rest = run_chunks(backbone, ids, mask, cache, chunk, past=first, offset=offset)
    return torch.cat([hidden, rest[0]]), offset


@torch.inference_mode()
def chunked_hidden_states(backbone: Backbone, records: Sequence[EncodedRecord], input_ids: torch.Tensor,
                          attention_mask: torch.Tensor, chunk: int) -> torch.Tensor:
    """The final hidden states ``[B, T, hidden]`` of a right-padded batch in chunks of ``chunk`` tokens.

    The text-only records run together over one cache (the chunks of a padded row carry its padding mask; the
    padding comes after every real token, so no real position reads it); each record with media runs alone through
    :func:`media_chunks` (positions past its end are zero: the head masks them). A text-only record is always run
    through the text model, as the one pass runs one that spells a vision pad token as text."""
    config = backbone.text_model.config
    media_rows = [i for i, r in enumerate(records) if r.media is not None]
    text_rows = [i for i in range(len(records)) if i not in media_rows]
    if not media_rows:
        return run_chunks(backbone, input_ids, attention_mask, new_cache(config), chunk)
    # the text rows together, then each media row: each group run and placed before the next starts
    groups: list[tuple[list[int], EncodedRecord | None]] = [(text_rows, None)] if text_rows else []
    groups += [([row], records[row]) for row in media_rows]
    out: torch.Tensor | None = None
    for rows, record in groups:
        if record is None:
            index = torch.tensor(rows, device=input_ids.device)
            hidden = run_chunks(backbone, input_ids[index], attention_mask[index], new_cache(config), chunk)
        else:
            hidden = media_chunks(backbone, record, chunk, new_cache(config))[0][None]
        if out is None:
            out = hidden.new_zeros((*input_ids.shape, hidden.shape[-1]))
        out[torch.tensor(rows, device=out.device), :hidden.shape[1]] = hidden
        del hidden
    if out is None:
        raise ValueError("chunked_hidden_states needs at least one record")
    return out

