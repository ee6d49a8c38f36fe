"""The torch side of the state cache (:mod:`clef_local.runtime.state_cache`): what a state pass leaves
(:class:`TorchState`, :func:`snapshot`) and the cache a continuation runs over (:func:`past_cache`). The passes
themselves are :mod:`clef_local.backends.torch_pass`'s one pass.

What is kept, why a hit is exact, the rope offset after media and which backbones qualify (:func:`cache_blocker`):
docs/serving.md#the-state-cache and docs/format.md §7.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache as memoized
from typing import Any

import torch


def new_cache(config: Any) -> Any:
    """An empty ``transformers`` ``DynamicCache`` laid out for ``config`` (one layer object per decoder layer)."""
    from transformers import DynamicCache

    return DynamicCache(config=config)


@dataclass(frozen=True)
class AttentionPast:
    """A full-attention layer's keys and values, ``[1, kv_heads, tokens, head_dim]``."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class LinearPast:
    """A linear-attention layer's states: conv ``[1, conv_dim, kernel]`` and recurrent ``[1, heads, d_k, d_v]``,
    one of each per state index (Qwen3.5 has one)."""

    conv: tuple[torch.Tensor, ...]
    recurrent: tuple[torch.Tensor, ...]
    kernel: tuple[int, ...]


LayerPast = AttentionPast | LinearPast


def _tensors(layer: LayerPast) -> tuple[torch.Tensor, ...]:
    if isinstance(layer, AttentionPast):
        return layer.keys, layer.values
    return (*layer.conv, *layer.recurrent)


def _moved(layer: LayerPast, device: torch.device) -> LayerPast:
    if isinstance(layer, AttentionPast):
        return AttentionPast(layer.keys.to(device), layer.values.to(device))
    return LinearPast(tuple(t.to(device) for t in layer.conv), tuple(t.to(device) for t in layer.recurrent),
                      layer.kernel)


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` owning exactly its own bytes (a view of a larger storage is copied), so byte counts are exact."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.contiguous().clone()


@dataclass(frozen=True)
class TorchState:
    """Everything a continuation needs of one state, on ``home`` (the compute device) or spilled to the host."""

    tokens: int  # prefix + media + state positions
    hidden: torch.Tensor  # [tokens, hidden]: final normed hidden states (the head's memory)
    layers: tuple[LayerPast, ...]
    home: torch.device  # the compute device, where continuations run
    # what the next token's rope position exceeds its index by: 0 for text, Qwen's rope delta after media
    position_offset: int = 0
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        tensors = (self.hidden, *(t for layer in self.layers for t in _tensors(layer)))
        object.__setattr__(self, "nbytes", sum(t.numel() * t.element_size() for t in tensors))

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def to_host(self) -> TorchState:
        if self.device.type == "cpu":
            return self
        host = torch.device("cpu")
        return replace(self, hidden=self.hidden.to(host), layers=tuple(_moved(layer, host) for layer in self.layers))

    def to_device(self) -> TorchState:
        if self.device == self.home:
            return self
        return replace(self, hidden=self.hidden.to(self.home),
                       layers=tuple(_moved(layer, self.home) for layer in self.layers))


def _layer_classes() -> tuple[Any, Any]:
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

    return DynamicLayer, LinearAttentionLayer


def cache_blocker(config: Any) -> str | None:
    """Why the state cache cannot run on a text model of ``config`` (None: it can). Every layer of its cache must be
    a plain full-attention ``DynamicLayer`` or a ``LinearAttentionLayer``: the layouts :func:`snapshot` reads and
    :func:`past_cache` rebuilds."""
    try:
        dynamic, linear = _layer_classes()
        layers = new_cache(config).layers
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        return f"this transformers has no per-layer DynamicCache ({exc})"
    if not layers:
        return "this transformers' DynamicCache does not lay out its layers from the config"
    for index, layer in enumerate(layers):
        if type(layer) not in (dynamic, linear):
            return f"layer {index} caches as {type(layer).__name__} (only full and linear attention are supported)"
    return None


def snapshot(cache: Any, hidden: torch.Tensor, home: torch.device, position_offset: int = 0) -> TorchState:
    """A :class:`TorchState` of a filled ``DynamicCache`` (batch 1) and the pass's ``[tokens, hidden]`` states;
    ``position_offset``: :attr:`TorchState.position_offset`."""
    dynamic, linear = _layer_classes()
    layers: list[LayerPast] = []
    for index, layer in enumerate(cache.layers):
        if type(layer) is dynamic:
            layers.append(AttentionPast(_compact(layer.keys), _compact(layer.values)))
        elif type(layer) is linear:
            slots = range(layer.number_of_states)
            layers.append(LinearPast(tuple(_compact(layer.conv_states[i]) for i in slots),
                                     tuple(_compact(layer.recurrent_states[i]) for i in slots),
                                     tuple(int(layer.conv_kernel_size[i]) for i in slots)))
        else:  # cache_blocker refused such a backbone before any pass
            raise TypeError(f"cache layer {index} is a {type(layer).__name__}, which the state cache cannot save")
    return TorchState(tokens=int(hidden.shape[0]), hidden=_compact(hidden), layers=tuple(layers), home=home,
                      position_offset=position_offset)


@memoized
def _past_layer_class() -> type:
    dynamic, _ = _layer_classes()

    class _PastLayer(dynamic):  # type: ignore[misc, valid-type]
        """A full-attention layer over a saved past: attention gets past + new keys/values. The past is shared by
        every continuation and never changes; the continuation's own keys/values are kept beside it, for its next
        chunk when it runs in chunks."""

        def __init__(self, past: AttentionPast, rows: int) -> None:
            super().__init__()
            self.keys, self.values = past.keys, past.values
            self.device, self.dtype = past.keys.device, past.keys.dtype
            self.is_initialized = True
            self.rows = rows
            self.added: tuple[torch.Tensor, torch.Tensor] | None = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            if self.added is not None:
                key_states = torch.cat([self.added[0], key_states], dim=-2)
                value_states = torch.cat([self.added[1], value_states], dim=-2)
            self.added = (key_states, value_states)
            keys = self.keys.expand(self.rows, -1, -1, -1)
            values = self.values.expand(self.rows, -1, -1, -1)
            return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)

        def get_seq_length(self) -> int:
            return int(self.keys.shape[-2]) + (0 if self.added is None else int(self.added[0].shape[-2]))

    return _PastLayer


def past_cache(config: Any, state: TorchState, rows: int) -> Any:
    """A fresh ``DynamicCache`` that continues ``state`` for ``rows`` records; ``state``'s tensors are only read."""
    cache = new_cache(config)
    past_layer = _past_layer_class()
    _, linear = _layer_classes()
    for index, (layer, past) in enumerate(zip(cache.layers, state.layers, strict=True)):
        if isinstance(past, AttentionPast):
            cache.layers[index] = past_layer(past, rows)
            continue
        if type(layer) is not linear:
            raise TypeError(f"cache layer {index} is a {type(layer).__name__}, the saved state a linear layer")
        for slot, (conv, recurrent, kernel) in enumerate(zip(past.conv, past.recurrent, past.kernel, strict=True)):
            # repeat() copies: transformers updates these states in place during the pass
            conv_rows, recurrent_rows = conv.repeat(rows, 1, 1), recurrent.repeat(rows, 1, 1, 1)
            layer.lazy_initialization(conv_states=conv_rows, recurrent_states=recurrent_rows, state_idx=slot,
                                      conv_kernel_size=kernel)
            layer.conv_states[slot].copy_(conv_rows)
            layer.recurrent_states[slot].copy_(recurrent_rows)
            layer.has_previous_state[slot] = True
    return cache


def is_out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: torch's ``OutOfMemoryError`` (CUDA, MPS) or the CPU allocator's RuntimeError."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "can't allocate memory" in text)
