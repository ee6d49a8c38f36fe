"""A GGUF release's vision tower on torch, beside llama.cpp's text model: a record with media as the spans that
:meth:`~clef_local.backends.llamacpp_context.LlamaCppContext.decode` takes.

``export-gguf`` keeps a Qwen3.5 release's vision tower byte for byte as ``gguf/vision.safetensors``. Here the
release's ``Qwen3_5ForConditionalGeneration`` is built on the meta device from its ``config.json`` (no memory), only
the tower's tensors are assigned, and the multimodal model (``model.model``) does the rest with transformers' own
code, as on the torch backend: ``get_image_features`` / ``get_video_features`` (the tower and its merger; Qwen3.5 has
no deepstack, so the rows at the pad tokens are all the text model reads of the media) and ``get_rope_index`` (the
multimodal rope positions, through :func:`clef_local.backends.torch_pass.rope_index`, the torch pass's own). The text
layers stay on meta: llama.cpp runs them. Imported only when a media request first reaches the llama.cpp backend.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from clef_local.backends.llamacpp_context import EmbeddingSpan, Span, TokenSpan
from clef_local.backends.skeleton import build_skeleton, materialize_non_persistent_buffers, read_shard
from clef_local.backends.torch_pass import collate_media, rope_index
from clef_local.errors import ReleaseError

if TYPE_CHECKING:
    from clef_local.formats.release import Release
    from clef_local.runtime.encoding import EncodedRecord

log = logging.getLogger(__name__)

TOWER_PREFIX = "model.visual."  # the tower's tensors in vision.safetensors, named as in the source release


def tower_device(device: str) -> torch.device:
    """The torch device the tower runs on beside llama.cpp's ``device``: the same GPU when this torch has it, else
    the CPU."""
    kind, _, index = device.partition(":")
    if kind in ("cuda", "gpu") and torch.cuda.is_available():
        return torch.device(f"cuda:{index or 0}" if kind == "cuda" else "cuda:0")
    if kind in ("mps", "gpu") and torch.backends.mps.is_available():
        return torch.device("mps")
    if kind not in ("cpu", "auto", ""):
        log.info("the vision tower runs on the CPU: this torch has no %s", device)
    return torch.device("cpu")


def tower_dtype(exact: bool, device: torch.device) -> torch.dtype:
    """float32 for an exact run (``dtype="float32"``), else what the torch backend would pick on ``device``
    (:func:`clef_local.planning.choice.default_dtype`: bf16 where it is fast, float32 on a CPU where it is not)."""
    from clef_local.planning.choice import default_dtype
    from clef_local.planning.hardware import detect

    if exact:
        return torch.float32
    name, why = default_dtype(detect(str(device) if device.type != "mps" else "mps"), "torch")
    log.debug("vision tower dtype %s: %s", name, why)
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class GgufVision:
    """The tower of ``release`` (``vision_file``: its ``gguf/vision.safetensors``) in ``dtype`` on ``device``, and
    :meth:`spans`."""

    def __init__(self, release: Release, vision_file: Path, *, device: torch.device, dtype: torch.dtype) -> None:
        import transformers

        self.device, self.dtype, self.file = device, dtype, Path(vision_file)
        model = build_skeleton(transformers.Qwen3_5ForConditionalGeneration, release.path, [self.file], None,
                               dtype).model
        expected = model.state_dict(keep_vars=True)
        try:
            state = read_shard(self.file, ())
        except Exception as exc:  # truncated data past a valid header
            raise ReleaseError(f"{self.file}: cannot read tensor data ({exc})") from exc
        foreign = sorted(n for n in state if not n.startswith(TOWER_PREFIX) or n not in expected)
        if foreign:
            raise ReleaseError(f"{self.file}: tensors that are not the config's vision tower: {', '.join(foreign[:5])}"
                               "; export the release again with `clef-local export-gguf`")
        state = {n: t.to(dtype) if t.is_floating_point() else t for n, t in state.items()}
        try:
            model.load_state_dict(state, strict=False, assign=True)
        except RuntimeError as exc:  # size mismatches
            raise ReleaseError(f"{self.file}: does not fit the vision_config of config.json ({exc})") from exc
        materialize_non_persistent_buffers(model)  # rotary inv_freq: no checkpoint holds them
        self.model = model.model  # Qwen3_5Model: the tower on device, the text layers on meta (llama.cpp runs them)
        missing = [n for n, t in self.model.visual.state_dict(keep_vars=True).items() if t.is_meta]
        if missing:
            raise ReleaseError(f"{self.file}: vision tower tensors missing: {', '.join(missing[:5])}; export the "
                               "release again with `clef-local export-gguf`")
        self.model.visual.to(device).eval()
        self.token_ids = {"image": int(self.model.config.image_token_id),
                          "video": int(self.model.config.video_token_id)}
        log.info("vision tower: %s (%d tensors) on torch, %s on %s", self.file, len(state),
                 str(dtype).removeprefix("torch."), device)

    @torch.inference_mode()
    def spans(self, record: EncodedRecord) -> list[Span]:
        """``record`` as token spans and embedding spans: the vision tower's rows at its image and video pad tokens,
        every position from transformers' ``get_rope_index`` (a token's: its temporal row, equal to the other two
        for text)."""
        if record.media is None:
            raise ValueError("spans needs a record with media")
        length = len(record.input_ids)
        ids = torch.tensor([record.input_ids], dtype=torch.long)
        media = collate_media([record], length, torch.device("cpu"))
        positions = rope_index(self.model, ids, torch.ones_like(ids), media)[0][:, 0].numpy()
        flat = ids[0].numpy()
        rows = self._features(media, flat)
        visual = np.zeros(length, dtype=bool)
        for token_id in self.token_ids.values():
            visual |= flat == token_id
        out: list[Span] = []
        edges = np.flatnonzero(np.diff(visual.astype(np.int8))) + 1
        for a, b in zip([0, *edges.tolist()], [*edges.tolist(), length], strict=True):
            if visual[a]:
                out.append(EmbeddingSpan(rows[visual[:a].sum():visual[:b].sum()], positions[:, a:b]))
            else:
                if not (positions[0, a:b] == positions[1:, a:b]).all():
                    raise ValueError(f"text tokens {a}-{b} have distinct temporal, height and width positions; "
                                     "llama.cpp gives a token one position for all three")
                out.append(TokenSpan(flat[a:b], positions[0, a:b]))
        return out

    def _features(self, media: dict[str, torch.Tensor], ids: np.ndarray) -> np.ndarray:
        """The tower's rows of every image and video pad token, in the sequence's order, float32 (as the
        multimodal model's forward places them: images at the image pads, videos at the video pads, in order)."""
        order = np.flatnonzero((ids == self.token_ids["image"]) | (ids == self.token_ids["video"]))
        rows = np.empty((len(order), self.model.config.text_config.hidden_size), dtype=np.float32)
        kinds = ids[order]
        for kind, pixels, grid, features in (
                ("image", "pixel_values", "image_grid_thw", self.model.get_image_features),
                ("video", "pixel_values_videos", "video_grid_thw", self.model.get_video_features)):
            at = kinds == self.token_ids[kind]
            if pixels not in media:
                if at.any():
                    raise ValueError(f"the record has {int(at.sum())} {kind} pad tokens and no {kind}")
                continue
            out: Any = features(media[pixels].to(self.device), media[grid].to(self.device), return_dict=True)
            values = torch.cat(out.pooler_output, dim=0).float().cpu().numpy()
            if len(values) != int(at.sum()):
                raise ValueError(f"{kind} features and {kind} tokens do not match, tokens: {int(at.sum())}, "
                                 f"features: {len(values)}")
            rows[at] = values
        return rows
