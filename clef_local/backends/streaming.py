"""A backbone streamed from its safetensors files, a group of decoder layers at a time (the numbers:
:mod:`clef_local.planning.stream`; docs/hardware.md#streamed-from-disk).

The model is built on the meta device (:func:`clef_local.backends.skeleton.build_skeleton`); what stays resident is
read once: the text model's weights outside the decoder layers (the final norm), the rotary buffers, and the vision
tower when the plan keeps it. ``embed_tokens`` and ``lm_head`` are never loaded: :class:`FileRows` reads the rows a
batch needs from the file. Each decoder layer gets a forward pre-hook that makes its group's tensors present (read by
:class:`~clef_local.backends.weight_reader.WeightReader`, cast to the compute dtype, assigned with
``load_state_dict(assign=True)``) and a forward hook that, after the group's last layer, assigns the meta tensors
back, which frees them. The text model's own forward passes the whole batch through layer i before layer i + 1, so a
batch reads every layer once (layer-major), with the model's own masks, rotary embeddings and layer types (Llama,
Qwen3.5's gated delta net and full attention alike); a worker thread reads the next group while this one computes.
A vision tower that does not stay resident is one more group, read for the passes with media only.

accelerate's ``AlignDevicesHook`` with an ``OffloadedWeightsLoader`` does the load-before / release-after part per
module, but reads each tensor when its own module runs (no prefetch, no group) and goes through
``set_module_tensor_to_device``, which casts every tensor to the parameter's old dtype — wrong for the packed
integer tensors of a quantized layer: hence these ~300 lines (docs/hardware.md says so too).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from clef_local.backends.quantized import after_stream_load, before_stream_release, stream_kernels
from clef_local.backends.skeleton import build_skeleton, materialize_non_persistent_buffers
from clef_local.backends.weight_reader import WeightReader
from clef_local.errors import ReleaseError
from clef_local.formats import mlx_layout
from clef_local.planning.stream import StreamDecision, groups_of

if TYPE_CHECKING:
    from clef_local.formats.quant_plan import LayerFormat

log = logging.getLogger(__name__)


class FileRows(nn.Module):
    """An embedding (or ``lm_head``) left in the weight file: ``forward(ids)`` reads the rows of ``ids`` and returns
    them in ``dtype`` on ``device``. ``weight`` is a meta tensor of the matrix's shape and dtype, for code that asks."""

    def __init__(self, reader: WeightReader, name: str, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        info = reader.tensors[name].info
        self.reader, self.name, self.dtype, self.device = reader, name, dtype, device
        self.weight = torch.empty(info.shape, dtype=dtype, device="meta")  # not a buffer: nothing loads or moves it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.reader.rows(self.name, ids, self.dtype).to(self.device)


@dataclass
class StreamStats:
    """What the streamed groups cost so far: bytes read, groups loaded, seconds the forward waited for a read."""

    loads: int = 0
    wait_seconds: float = 0.0
    read_seconds: float = 0.0


class GroupStreamer:
    """``modules`` (name, module) loaded from ``reader`` around their forward passes, in ``groups`` of consecutive
    indices: a group's tensors are present from its first module's pre-hook to its last module's hook; with
    ``prefetch`` the next group is read on a worker thread meanwhile."""

    def __init__(self, modules: Sequence[tuple[str, nn.Module]], groups: Sequence[Sequence[int]],
                 reader: WeightReader, *, device: torch.device, prefetch: bool = True, label: str = "layers") -> None:
        self.modules = [m for _, m in modules]
        self.groups = [list(g) for g in groups]
        self.reader, self.device, self.prefetch, self.label = reader, device, prefetch, label
        self.group_of = {i: n for n, g in enumerate(self.groups) for i in g}
        self.stats = StreamStats()
        # per module: the file name and the dtype (the skeleton's: the compute dtype, or a packed tensor's own) of
        # every tensor its state dict holds, keyed as load_state_dict takes them; and the meta tensors to put back
        self.slots: list[dict[str, tuple[str, torch.dtype]]] = []
        self.templates: list[dict[str, torch.Tensor]] = []
        for name, module in modules:
            template = {key: torch.empty_like(t, device="meta") for key, t in module.state_dict(keep_vars=True).items()}
            prefix = f"{name}."
            held = {key[len(prefix):] for key in reader.tensors if key.startswith(prefix)}
            missing, extra = sorted(set(template) - held), sorted(held - set(template))
            if missing or extra:
                raise ReleaseError(f"the weight files do not match {label} {name}: missing {missing[:5]}, unknown "
                                   f"{extra[:5]}")
            self.slots.append({key: (prefix + key, t.dtype) for key, t in template.items()})
            self.templates.append(template)
        self.current: int | None = None
        self.pending: tuple[int, Future[list[dict[str, torch.Tensor]]]] | None = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-stream") if prefetch else None
        self.handles: list[Any] = []
        for index, module in enumerate(self.modules):
            self.handles.append(module.register_forward_pre_hook(partial(self._before, index)))
            self.handles.append(module.register_forward_hook(partial(self._after, index)))

    @property
    def group_bytes(self) -> list[int]:
        """Stored bytes of each group."""
        return [self.reader.nbytes(name for i in g for name, _ in self.slots[i].values()) for g in self.groups]

    def start(self, *_: Any) -> None:
        """A pass is about to reach these modules: read the first group ahead (a forward pre-hook of the model)."""
        if self.pool is not None and self.current is None and self.pending is None:
            self.pending = (0, self.pool.submit(self._read, 0))

    def release_all(self) -> None:
        """Free every loaded or prefetched group (after a pass that stopped half-way, or at the end)."""
        self._drop_pending()
        if self.current is not None:
            self._release(self.current)

    def close(self) -> None:
        self.release_all()
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def _before(self, index: int, module: nn.Module, args: Any) -> None:
        group = self.group_of[index]
        if group == self.current:
            return
        if self.current is not None:  # a pass cut short by an error, or modules run out of order
            self._release(self.current)
        states = self._take(group)
        for i, state in zip(self.groups[group], states, strict=True):
            try:
                self.modules[i].load_state_dict(state, strict=True, assign=True)
            except RuntimeError as exc:  # a stored shape that does not fit the module
                raise ReleaseError(f"the weight files do not fit {self.label} {i}: {exc}") from exc
            after_stream_load(self.modules[i])
        self.current = group
        self.stats.loads += 1
        if self.pool is not None and group + 1 < len(self.groups) and self.pending is None:
            self.pending = (group + 1, self.pool.submit(self._read, group + 1))

    def _after(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        group = self.group_of[index]
        if group == self.current and index == self.groups[group][-1]:
            self._release(group)

    def _take(self, group: int) -> list[dict[str, torch.Tensor]]:
        """The group's tensors: the prefetched ones when they are this group's, else read now."""
        if self.pending is not None:
            pending, future = self.pending
            self.pending = None
            started = time.perf_counter()
            states = future.result()
            self.stats.wait_seconds += time.perf_counter() - started
            if pending == group:
                return states
            del states  # read ahead for a pass that went elsewhere
        started = time.perf_counter()
        states = self._read(group)
        self.stats.wait_seconds += time.perf_counter() - started
        return states

    def _drop_pending(self) -> None:
        if self.pending is not None:
            _, future = self.pending
            self.pending = None
            if not future.cancel():
                future.result()  # let the read finish; its tensors die here

    def _read(self, group: int) -> list[dict[str, torch.Tensor]]:
        """Read (worker thread, or the forward's when nothing was prefetched) one group's tensors onto the device."""
        started = time.perf_counter()
        out = [{key: self.reader.read(name, dtype).to(self.device) for key, (name, dtype) in self.slots[i].items()}
               for i in self.groups[group]]
        self.stats.read_seconds += time.perf_counter() - started
        return out

    def _release(self, group: int) -> None:
        for i in self.groups[group]:
            before_stream_release(self.modules[i])
            self.modules[i].load_state_dict(self.templates[i], strict=True, assign=True)
        self.current = None


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}


class StreamedModel:
    """The skeleton of a release's backbone, its resident part loaded, its decoder layers (and vision tower, when
    ``stream.vision`` is ``"streamed"``) behind :class:`GroupStreamer` hooks, its embeddings :class:`FileRows`.

    ``kernels``: {path: "scheme:kernel"} of a variant's quantized layers (:func:`~clef_local.backends.quantized.
    stream_kernels`); ``lexical_rows(ids)``: the output embedding's rows."""

    def __init__(self, cls: Any, path: Path, weight_files: Sequence[Path], scheme: str | None, dtype: torch.dtype,
                 device: torch.device, stream: StreamDecision,
                 plan: Mapping[int, LayerFormat] | None = None) -> None:
        model = build_skeleton(cls, path, weight_files, scheme, dtype, plan).model
        model.requires_grad_(False)
        self.model = model
        self.reader = reader = WeightReader(weight_files)
        renamed = next((n for n in reader.tensors if mlx_layout.is_mlx_name(n)), None)
        if renamed is not None:
            raise ReleaseError(f"{path}: {renamed} is stored in MLX's layout (an mlx-vlm conversion renames, "
                               f"transposes and offsets tensors); streamed runs read tensors from the file as stored, "
                               f"which needs them as released: load it without streaming (it is converted at load)")
        base = model.model
        text_model = getattr(base, "language_model", base)
        names = _module_names(model)
        expected = model.state_dict(keep_vars=True)
        for embedding in (text_model.get_input_embeddings(), model.get_output_embeddings()):
            if f"{names[id(embedding)]}.scales" in reader:
                raise ReleaseError(f"{path}: {names[id(embedding)]}.weight is int4 (an mlx-lm conversion quantizes "
                                   f"embeddings); streamed runs read embedding rows from the file as stored, which "
                                   f"needs them as released: load it without streaming (it is dequantized at load)")
        ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
        unknown = sorted(n for n in reader.tensors if n not in expected and not any(p.search(n) for p in ignored))
        if unknown:
            raise ReleaseError(f"{path}: tensors the backbone does not have: {', '.join(unknown[:10])}")
        embed_name = f"{names[id(text_model.get_input_embeddings())]}.weight"
        output_name = f"{names[id(model.get_output_embeddings())]}.weight"
        if output_name not in reader:  # tied to the input embedding (tie_word_embeddings)
            output_name = embed_name
        for name in (embed_name, output_name):
            if name not in reader:
                raise ReleaseError(f"{path}: {name} is in none of the weight files")
        layers = list(text_model.layers)
        layer_names = [names[id(layer)] for layer in layers]
        vision = getattr(base, "visual", None)
        streamed_vision = vision is not None and stream.vision == "streamed"
        streamed = tuple(f"{n}." for n in layer_names + ([names[id(vision)]] if streamed_vision else []))
        tied = {embed_name, f"{names[id(model.get_output_embeddings())]}.weight"}
        resident = {n: t for n, t in expected.items() if not n.startswith(streamed) and n not in tied}
        missing = sorted(n for n in resident if n not in reader)
        if missing:
            raise ReleaseError(f"{path}: tensors missing from the weight files: {', '.join(missing[:10])}")
        state = {n: reader.read(n, t.dtype).to(device) for n, t in resident.items()}
        model.load_state_dict(state, strict=False, assign=True)
        del state
        materialize_non_persistent_buffers(model)  # before FileRows come in: they hold nothing to materialize
        _buffers_to(model, device)
        self.embeddings = FileRows(reader, embed_name, dtype, device)
        text_model.set_input_embeddings(self.embeddings)
        self.output = self.embeddings if output_name == embed_name else FileRows(reader, output_name, dtype, device)
        self.kernels = stream_kernels(model)
        self.resident_bytes = reader.nbytes(resident)
        self.layers = GroupStreamer(list(zip(layer_names, layers, strict=True)),
                                    groups_of(len(layers), stream.group_layers), reader, device=device,
                                    prefetch=stream.prefetch, label="decoder layer")
        base.register_forward_pre_hook(self.layers.start)  # the media pass's vision tower runs meanwhile
        text_model.register_forward_pre_hook(self.layers.start)
        self.vision: GroupStreamer | None = None
        if streamed_vision:
            self.vision = GroupStreamer([(names[id(vision)], vision)], [[0]], reader, device=device, prefetch=False,
                                        label="vision tower")
        log.info("streaming %d decoder layers from %s in groups of %d (%s resident, vision %s)", len(layers), path,
                 stream.group_layers, f"{self.resident_bytes / 1e9:.2f} GB",
                 "streamed" if streamed_vision else "resident" if vision is not None else "none")

    def lexical_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The output embedding's rows of ``token_ids``, read from the file."""
        return self.output(token_ids)

    def describe(self) -> dict[str, Any]:
        """Bytes read so far and the seconds spent reading and waiting (``inspect``, the streaming benchmark)."""
        stats = self.layers.stats
        return {"group_layers": len(self.layers.groups[0]), "groups": len(self.layers.groups),
                "resident_bytes": self.resident_bytes, "layer_bytes": sum(self.layers.group_bytes),
                "vision": "streamed" if self.vision is not None else "resident or none",
                "bytes_read": self.reader.bytes_read, "group_loads": stats.loads,
                "read_seconds": round(stats.read_seconds, 3), "wait_seconds": round(stats.wait_seconds, 3)}

    def close(self) -> None:
        """Free the loaded groups, stop the worker thread, close the files."""
        self.layers.close()
        if self.vision is not None:
            self.vision.close()
        self.reader.close()


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move the materialized non-persistent buffers (rotary ``inv_freq``, on the CPU) to ``device``."""
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                module._buffers[name] = buffer.to(device)
