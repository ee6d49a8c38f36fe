"""The llama.cpp backend: a GGUF text backbone (``gguf/model.gguf``) through llama.cpp and the joint schema head in
numpy, like the ONNX Runtime backend. Needs neither torch nor safetensors for the backbone.

The GGUF is checked against its release before llama.cpp parses it
(:func:`clef_local.formats.gguf_release.check_gguf`: a malformed file would reach C++ code). Records run one at a
time through :class:`~clef_local.backends.llamacpp_context.LlamaCppContext` (one sequence, chunked decode, memory
cleared per request); the head reads the batch right-padded as on every backend. The lexical rows come from the
GGUF's own ``output.weight`` (or the tied ``token_embd.weight``), only the rows a request needs, dequantized by
gguf-py. ``dtype="float32"`` asks for an F32 KV cache without flash attention, for exact comparisons with torch
float32; otherwise the KV cache is F16.

Images and videos: a release with a vision tower (``gguf/vision.safetensors`` and a ``vision_config``) runs the tower
on torch (:mod:`clef_local.backends.gguf_vision`, built on the first media request; float32 with ``dtype="float32"``,
else the torch backend's dtype for the device) and feeds its rows to llama.cpp as input embeddings at the image and
video pad tokens, at transformers' multimodal rope positions (:meth:`LlamaCppContext.decode`). Without the file, or
without torch, a media request is refused in one line (:attr:`LlamaCppBackend.media_refusal`).
docs/hardware.md#llamacpp.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from clef_local.errors import ApiUsageError
from clef_local.formats.gguf_release import VISION_PATH
from clef_local.formats.release import Release
from clef_local.heads.numpy_head import load_head
from clef_local.planning.hardware import thread_plan
from clef_local.planning.llamacpp_build import llama_cpp_build
from clef_local.runtime.state_cache import model_identity

if TYPE_CHECKING:
    from clef_local.backends.gguf_vision import GgufVision
    from clef_local.planning.choice import LoadDecision
    from clef_local.planning.prefill import PrefillBudget
    from clef_local.runtime.encoding import EncodedRecord
    from clef_local.runtime.layout import HeadLayout
    from clef_local.runtime.state_cache import StateCache

log = logging.getLogger(__name__)

# what runs the vision tower beside llama.cpp (clef_local.backends.gguf_vision): torch and transformers, core
# dependencies that only an install running GGUF text models alone leaves out
VISION_INSTALL = ("pip install torch && pip install clef-local (torch and transformers are clef-local's core "
                  "dependencies; torch first, as the README installs it)")


class LlamaCppBackend:
    """Runs ``gguf/model.gguf`` through llama.cpp and the head in numpy float32."""

    name = "llamacpp"
    accepts_media = False  # set per release: True with a vision tower beside the GGUF and torch to run it
    media_refusal: str | None = None  # why a media request is refused (ClefModel says it in one line)
    state_cache_blocker = "the llama.cpp backend runs every state in full (the state cache is torch's)"
    batch_tokens: int | None = None  # the device's default batches (ClefModel.run)
    pad_waste: float | None = None
    load_decision: LoadDecision | None = None  # set by clef_local.backends.loader
    prefill: PrefillBudget | None = None  # set by clef_local.backends.loader

    def __init__(self, release: Release, *, device: str = "cpu", dtype: str | None = None,
                 context: int | None = None, chunk: int | None = None) -> None:
        from clef_local.backends.llamacpp_context import LlamaCppContext
        from clef_local.formats.gguf_release import checked_table
        from clef_local.planning.gguf_plan import chunk_for, kv_dtype
        from clef_local.runtime.encoding import default_max_length

        if release.gguf is None:
            raise ApiUsageError(f"{release.path} has no gguf/model.gguf; write one with `clef-local export-gguf "
                                f"--model {release.path} --out DIR` and load DIR")
        self.release = release
        self.gguf = release.gguf
        self.table = checked_table(self.gguf, release)  # check_gguf before llama.cpp parses a byte of it
        self.device = "cpu" if device in ("auto", "") else device
        self.kv_dtype = kv_dtype(dtype)
        if dtype not in (None, "auto", "float32", "float16"):
            log.warning("the llamacpp backend computes in the GGUF's own types; dtype %r sets only the KV cache, "
                        "which is float16 (float32 asks for the exact one)", dtype)
        context = context or default_max_length(release.max_position_embeddings)
        self.thread_plan = thread_plan(workers=1)
        self.context = LlamaCppContext(self.gguf, context=context, chunk=chunk or chunk_for(self._vocab()),
                                       kv_type="f32" if self.kv_dtype == "float32" else "f16",
                                       threads=self.thread_plan, device=self.device)
        self._lock = threading.Lock()  # one llama.cpp context: one request at a time
        self.head = load_head(release)
        self.vision_file = release.path / VISION_PATH
        self.media_refusal = vision_refusal(release)
        self.accepts_media = self.media_refusal is None
        self._vision: GgufVision | None = None  # the tower on torch, built on the first media request
        weights = [self.gguf, self.vision_file] if self.accepts_media else [self.gguf]
        self.state_identity = model_identity(release.path, weights, backend=self.name, device=self.device,
                                             dtype=self.kv_dtype)
        log.info("llamacpp backend: %s (%s) on %s, context %s in %d-token chunks, %s KV cache; %s", self.gguf,
                 self.table.file_type, self.device, f"{self.context.n_ctx:,}", self.context.n_batch, self.kv_dtype,
                 self.thread_plan.describe())

    def _vocab(self) -> int:
        return self.table.tensors[self.table.lexical_tensor].shape[0]

    def hidden_states(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                      records: Sequence[EncodedRecord] | None = None) -> np.ndarray:
        """``[B, T, hidden]`` float32 for a right-padded batch: each record's real tokens through llama.cpp on
        their own, zeros on padding (the head masks it). A record of ``records`` with media runs as spans: its
        tokens, and the vision tower's rows at its pad tokens (:meth:`vision`)."""
        batch, width = input_ids.shape
        out = np.zeros((batch, width, self.context.hidden_size), dtype=np.float32)
        with self._lock:
            for row in range(batch):
                length = int(attention_mask[row].sum())
                record = records[row] if records is not None else None
                if record is not None and record.media is not None:
                    out[row, :length] = self.context.decode(self.vision().spans(record))
                else:
                    out[row, :length] = self.context.hidden_states(input_ids[row, :length])
        return out

    def vision(self) -> GgufVision:
        """The vision tower on torch, built on first use (a media request); refused in one line when this release
        or this install cannot run it."""
        if self.media_refusal is not None:
            raise ApiUsageError(self.media_refusal)
        if self._vision is None:
            from clef_local.backends.gguf_vision import GgufVision, tower_device, tower_dtype

            device = tower_device(self.device)
            self._vision = GgufVision(self.release, self.vision_file, device=device,
                                      dtype=tower_dtype(self.kv_dtype == "float32", device))
        return self._vision

    def lexical_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """Output-embedding rows of ``token_ids`` as float32, read from the GGUF (only those rows)."""
        return self.table.rows(self.table.lexical_tensor, token_ids)

    def logits(self, records: Sequence[EncodedRecord], layout: HeadLayout, pad_token_id: int,
               cache: StateCache | None = None) -> np.ndarray:
        """Option logits ``[questions, max_options]`` (float32, ``-inf`` padding) for right-padded ``records``."""
        from clef_local.runtime.layout import pad_batch

        if cache is not None:
            raise ValueError(self.state_cache_blocker)
        input_ids, attention_mask = pad_batch(records, pad_token_id)
        hidden = self.hidden_states(input_ids, attention_mask, records)
        return self.head(hidden, attention_mask, self.lexical_rows(layout.option_token_ids), layout)

    def close(self) -> None:
        """Free llama.cpp's context and model."""
        self.context.close()

    def describe(self) -> dict[str, Any]:
        config = self._gguf_config()
        return {"backend": self.name, "device": self.device, **llama_cpp_build(),
                "gguf": str(self.gguf), "gguf_architecture": self.table.architecture,
                "gguf_file_type": self.table.file_type, "gguf_type": config.get("type") if config else None,
                "written_by": "clef-local export-gguf" if config else "another tool (no gguf/gguf_config.json)",
                "tensor_types": self.table.type_counts, "lexical_rows": self.table.lexical_tensor,
                "lexical_rows_type": self.table.tensors[self.table.lexical_tensor].type,
                "kv_cache": self.kv_dtype, "n_ctx": self.context.n_ctx, "decode_chunk": self.context.n_batch,
                "flash_attention": "off" if self.kv_dtype == "float32" else "auto", "head_dtype": "float32",
                "head_runtime": "numpy", "threads": self.thread_plan.intra_op,
                "vision": self._vision_description()}

    def _vision_description(self) -> str:
        if self.media_refusal is not None:
            return f"none: {self.media_refusal}"
        if self._vision is None:
            return f"{VISION_PATH} on torch, built on the first image or video"
        return (f"{VISION_PATH} on torch, {str(self._vision.dtype).removeprefix('torch.')} on "
                f"{self._vision.device}")

    def _gguf_config(self) -> dict[str, Any] | None:
        from clef_local.formats.gguf_release import read_gguf_config

        return read_gguf_config(self.release.path)


def vision_refusal(release: Release) -> str | None:
    """Why the llama.cpp backend cannot run ``release``'s images and videos (None: it can): no vision tower in
    the config, no ``gguf/vision.safetensors`` beside the GGUF, or no torch/transformers to run it."""
    from importlib.util import find_spec

    if not release.has_vision:
        return f"{release.path.name} has no vision tower (no vision_config in config.json)"
    if not (release.path / VISION_PATH).is_file():
        return (f"{release.path.name} has no {VISION_PATH} beside its GGUF, so the llamacpp backend does not run the "
                f"vision tower; export it again with `clef-local export-gguf` (it keeps the tower), or load its "
                f"source release (safetensors) with --backend torch to send images or videos")
    missing = [name for name in ("torch", "transformers") if find_spec(name) is None]
    if missing:
        return (f"images and videos on the llamacpp backend run the vision tower on torch, and "
                f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: {VISION_INSTALL}")
    return None
