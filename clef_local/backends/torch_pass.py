"""The one torch pass: a batch of encoded records through the backbone, to the final hidden states the head reads.

:func:`hidden_states` is the only place the torch backend runs the backbone for requests. It groups the rows (the
text-only records together, each record with media alone), takes a state from the state cache when it holds one
(only the schema tokens then run over that past), and runs each group in the chunks the planner sized
(:mod:`clef_local.planning.prefill`). Chunks are cut at multiples of the chunk length counted from the first
position, so a chunk boundary is also one of the gated delta rule's 64-token blocks and a chunked pass does the one
pass's arithmetic block for block; a record with media runs its first chunk through the multimodal model (vision
tower, Qwen's multimodal rope), extended to hold all its media, and the rest through the text model at the rope
offset the media left. What a state keeps and why a hit is exact: :mod:`clef_local.backends.torch_cache`,
docs/serving.md#the-state-cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from clef_local.backends.torch_cache import TorchState, new_cache, past_cache, snapshot
from clef_local.runtime.layout import pad_batch
from clef_local.runtime.state_cache import StateCache, record_state_key, state_end

if TYPE_CHECKING:
    from clef_local.runtime.encoding import EncodedRecord

# (tokens, rows) → the chunk length of a pass of rows × tokens (None: one piece; clef_local.planning.prefill)
ChunkFor = Callable[[int, int], "int | None"]


def one_pass(tokens: int, rows: int) -> int | None:
    """The :data:`ChunkFor` of a backbone with no prefill budget: never chunk."""
    return None


class Backbone(Protocol):
    """What the pass needs of :class:`clef_local.backends.torch_backend.TorchBackbone`."""

    device: torch.device
    text_model: Any
    model: Any

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, cache: Any = None,
                position_ids: torch.Tensor | None = None,
                media: dict[str, torch.Tensor] | None = None) -> torch.Tensor: ...


def collate(records: Sequence[EncodedRecord], pad_token_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Right-padded ``input_ids`` and ``attention_mask`` (1 on real tokens)."""
    ids, mask = pad_batch(records, pad_token_id)
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


def collate_media(records: Sequence[EncodedRecord], length: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's media as ``model.model`` takes them: each array concatenated over the records that have it (in
    batch order), and ``mm_token_type_ids`` ``[B, length]``, zero except at each record's media ids (the batch may
    be cut to ``length`` positions; media sit right after the prefix, before any cut)."""
    from clef_local.runtime.encoding import MEDIA_ARRAYS

    out: dict[str, torch.Tensor] = {}
    for name in MEDIA_ARRAYS:
        arrays = [getattr(r.media, name) for r in records if r.media is not None and getattr(r.media, name) is not None]
        if arrays:
            out[name] = torch.from_numpy(np.concatenate(arrays, axis=0)).to(device)
    types = np.zeros((len(records), length), dtype=np.int64)
    for row, record in enumerate(records):
        if record.media is not None:
            start = record.media.token_offset
            values = np.asarray(record.media.mm_token_type_ids, dtype=np.int64)[: max(0, length - start)]
            types[row, start:start + len(values)] = values
    out["mm_token_type_ids"] = torch.from_numpy(types).to(device)
    return out


def rope_index(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               media: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Qwen's multimodal rope positions ``[3, B, T]`` (temporal, height, width) of ``input_ids`` with ``media``
    (:func:`collate_media`'s), from the multimodal ``model`` 's own ``get_rope_index`` (``model.model`` of
    ``Qwen3_5ForConditionalGeneration``; it reads only the config, so a model on the meta device will do), and the
    rope offset they leave (the first row's delta: the text after the media sits at token index + offset). The
    torch pass and the llama.cpp backend's vision path (:mod:`clef_local.backends.gguf_vision`) both place media
    by it."""
    get_rope_index = getattr(model, "get_rope_index", None)
    if get_rope_index is None:
        raise TypeError(f"{type(model).__name__} has no get_rope_index: this transformers does not give the "
                        "multimodal rope positions a chunked, cached or llama.cpp pass places media by")
    positions, deltas = get_rope_index(input_ids, mm_token_type_ids=media["mm_token_type_ids"],
                                       image_grid_thw=media.get("image_grid_thw"),
                                       video_grid_thw=media.get("video_grid_thw"), attention_mask=attention_mask)
    return positions, int(deltas.reshape(-1)[0])


def chunk_bounds(start: int, end: int, chunk: int | None, first_end: int | None = None) -> list[tuple[int, int]]:
    """``[a, b)`` of each chunk of the positions ``start`` … ``end - 1``, cut at the multiples of ``chunk`` (None:
    one piece); ``first_end``: the first chunk reaches at least there (a record's media stay in one chunk)."""
    if chunk is None or chunk < 1:
        return [(start, end)]
    bounds: list[tuple[int, int]] = []
    a = start
    while a < end:
        b = min(end, (a // chunk + 1) * chunk)
        if not bounds and first_end is not None:
            b = min(end, max(b, -(-first_end // chunk) * chunk))
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


@dataclass
class Run:
    """One run of the backbone over some rows of the batch: ``ids`` ``[rows, T]`` after the ``past`` positions
    ``kv`` already holds, ``mask`` ``[rows, past + T]``.

    ``kv`` is a ``transformers`` cache filled (or continued) in place, or None for a pass that keeps nothing.
    ``media_record``: the one record of a run with media, whose media inputs its first chunk takes (the multimodal
    model); ``offset``: the rope offset after media. ``key``: a state pass, stored in the state cache under that key
    when it ends, then continued for ``rows``; else the run's states fill ``rows`` of the output from position
    ``past`` (``state``: the cached state whose hidden states fill the positions before it)."""

    rows: list[int]
    ids: torch.Tensor
    mask: torch.Tensor
    kv: Any = None
    past: int = 0
    offset: int = 0
    media_record: EncodedRecord | None = None
    key: str | None = None
    state: TorchState | None = None

    def bounds(self, chunk_for: ChunkFor) -> list[tuple[int, int]]:
        rows, end = self.ids.shape[0], self.past + self.ids.shape[1]
        media = None if self.media_record is None else self.media_record.media
        media_end = None if media is None else media.token_offset + len(media.token_ids)
        return chunk_bounds(self.past, end, chunk_for(end, rows), media_end)

    def positions(self, backbone: Backbone, a: int, b: int, one_piece: bool) -> tuple[torch.Tensor | None,
                                                                                      dict[str, torch.Tensor] | None]:
        """The position ids and media inputs of the chunk ``[a, b)``. A pass in one piece that keeps nothing lets
        the model place its tokens itself, as a plain forward does; a chunk with media gets Qwen's multimodal rope
        positions, and the offset they leave is kept for the chunks and continuations after it."""
        rows, device = self.ids.shape[0], self.ids.device
        plain = one_piece and self.kv is None
        if self.media_record is None or a != self.past:
            return (None if plain else chunk_positions(a, b - a, rows, device, self.offset)), None
        media = collate_media([self.media_record], b, device)
        if plain:
            return None, media
        positions, self.offset = rope_index(backbone.model.model, self.ids[:, :b], self.mask[:, :b], media)
        return positions, media


def _tokens(rows: Sequence[Sequence[int]], pad_token_id: int, past: int, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` of token ids right-padded, and their mask over ``past`` cached positions and the tokens."""
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), past + longest), dtype=torch.long)
    mask[:, :past] = 1
    for row, tokens in enumerate(rows):
        ids[row, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.long)
        mask[row, past : past + len(tokens)] = 1
    return ids.to(device), mask.to(device)


def continuation(backbone: Backbone, records: Sequence[EncodedRecord], rows: list[int], state: TorchState,
                 pad_token_id: int) -> Run:
    """The run of ``rows``' tokens after ``state`` (their schemas), over a cache that continues it; ``state``'s
    tensors are only read."""
    ids, mask = _tokens([records[row].input_ids[state.tokens:] for row in rows], pad_token_id, state.tokens,
                        backbone.device)
    return Run(rows, ids, mask, past_cache(backbone.text_model.config, state, len(rows)), past=state.tokens,
               offset=state.position_offset, state=state)


def runs(backbone: Backbone, records: Sequence[EncodedRecord], input_ids: torch.Tensor,
         attention_mask: torch.Tensor, pad_token_id: int, cache: StateCache | None, identity: str) -> list[Run]:
    """The batch as runs. Without a cache: the text-only records together (a record that spells a vision pad token
    as text among them: the text model reads it as text), then each record with media alone. With one: the records
    grouped by state; a cached state is continued, an uncached one runs its state pass first."""
    device = backbone.device
    if cache is None:
        text = [i for i, r in enumerate(records) if r.media is None]
        out = []
        if len(text) == len(records):
            out.append(Run(text, input_ids, attention_mask))
        elif text:
            index = torch.tensor(text, device=input_ids.device)
            out.append(Run(text, input_ids[index], attention_mask[index]))
        for i, record in enumerate(records):
            if record.media is not None:  # its own row of the collated batch, without the padding
                n = len(record.input_ids)
                out.append(Run([i], input_ids[i:i + 1, :n], attention_mask[i:i + 1, :n], media_record=record))
        return out
    groups: dict[str, list[int]] = {}
    for row, record in enumerate(records):
        groups.setdefault(record_state_key(identity, record), []).append(row)
    out = []
    for key, rows in groups.items():
        state = cache.get(key, uses=len(rows))
        if state is not None:
            if not isinstance(state, TorchState):
                raise TypeError(f"the state cache holds a {type(state).__name__}, not a TorchState")
            out.append(continuation(backbone, records, rows, state, pad_token_id))
            continue
        first = records[rows[0]]
        ids, mask = _tokens([first.input_ids[: state_end(first)]], pad_token_id, 0, device)
        out.append(Run(rows, ids, mask, new_cache(backbone.text_model.config),
                       media_record=first if first.media is not None else None, key=key))
    return out


@torch.inference_mode()
def hidden_states(backbone: Backbone, records: Sequence[EncodedRecord], input_ids: torch.Tensor,
                  attention_mask: torch.Tensor, pad_token_id: int, *, chunk_for: ChunkFor = one_pass,
                  cache: StateCache | None = None, identity: str = "") -> torch.Tensor:
    """The final (normed) hidden states ``[B, T, hidden]`` of a right-padded batch of ``records`` (``input_ids``,
    ``attention_mask``: the batch collated); positions past a record's run are zero or padding states (the head
    masks them). ``cache``: the state cache, looked up and filled under ``identity``'s keys."""
    queue = deque(runs(backbone, records, input_ids, attention_mask, pad_token_id, cache, identity))
    out: torch.Tensor | None = None
    while queue:
        run = queue.popleft()
        bounds = run.bounds(chunk_for)
        if len(bounds) > 1 and run.kv is None:  # each chunk continues what the chunks before it left
            run.kv = new_cache(backbone.text_model.config)
        hidden: torch.Tensor | None = None
        for a, b in bounds:
            positions, media = run.positions(backbone, a, b, len(bounds) == 1)
            piece = backbone.forward(run.ids[:, a - run.past:b - run.past], run.mask[:, :b], cache=run.kv,
                                     position_ids=positions, media=media)
            if len(bounds) == 1:
                hidden = piece
            else:
                if hidden is None:
                    hidden = piece.new_empty((*run.ids.shape, piece.shape[-1]))
                hidden[:, a - run.past:b - run.past] = piece
            del piece
        if hidden is None:
            raise ValueError("a backbone run needs at least one token")
        if run.key is not None and cache is not None:  # a state pass: keep it, then run the schemas after it
            state = snapshot(run.kv, hidden[0], backbone.device, position_offset=run.offset)
            cache.put(run.key, state)
            queue.appendleft(continuation(backbone, records, run.rows, state, pad_token_id))
            continue
        if len(run.rows) == len(records) and run.past == 0 and hidden.shape[1] == input_ids.shape[1]:
            return hidden  # the whole batch in one run: no copy
        if out is None:
            out = hidden.new_zeros((*input_ids.shape, hidden.shape[-1]))
        index = torch.tensor(run.rows, device=out.device)
        if run.state is not None:
            out[index, : run.past] = run.state.hidden.to(out.dtype)
        out[index, run.past : run.past + hidden.shape[1]] = hidden
    if out is None:
        raise ValueError("hidden_states needs at least one record")
    return out
