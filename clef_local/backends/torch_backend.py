"""The PyTorch backend: the backbone's text model through ``transformers``, the head in float32.

Real Clef releases are ``Qwen3_5ForConditionalGeneration`` (text model + vision tower); any Hugging Face causal
LM (Llama, Qwen3, ...) works as a backbone too, which is what small test and demo releases use.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from clef_local.errors import ReleaseError
from clef_local.layout import HeadLayout
from clef_local.release import Release, load_head

if TYPE_CHECKING:
    from clef_local.encoding import EncodedRecord

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype | None, release: Release) -> torch.dtype:
    """``None``/``"auto"`` is the release's stored dtype; a name or a torch dtype is taken as given."""
    if isinstance(name, torch.dtype):
        return name
    key = release.dtype if name in (None, "auto") else name
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {key!r}; use one of {', '.join(DTYPES)} or 'auto'")
    return DTYPES[key]


class TorchBackend:
    """Runs the backbone and the head for a padded batch of encoded records."""

    name = "torch"

    def __init__(self, release: Release, *, device: str = "cpu", dtype: str | torch.dtype | None = None) -> None:
        self.release = release
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, release)
        self.model = self._load_backbone()
        base = self.model.model
        # Without media only the text model runs (DESIGN §2.2); with a vision tower it sits beside it.
        self.text_model = getattr(base, "language_model", base)
        self.output_embedding = self.model.get_output_embeddings().weight
        self.head = load_head(release, device=self.device)

    def _load_backbone(self) -> Any:
        import transformers

        cls = (transformers.Qwen3_5ForConditionalGeneration if self.release.is_qwen3_5
               else transformers.AutoModelForCausalLM)
        log.info("loading %s backbone from %s in %s", self.release.architecture, self.release.path, self.dtype)
        try:
            model = cls.from_pretrained(self.release.path, dtype=self.dtype, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ReleaseError(f"{self.release.path}: the backbone cannot be loaded ({exc})") from exc
        model.config.use_cache = False
        return model.to(self.device).eval()

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The text model's final (normed) hidden states, ``[B, T, hidden]``."""
        out = self.text_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                              return_dict=True)
        return out.last_hidden_state

    @torch.inference_mode()
    def logits(self, records: list[EncodedRecord], layout: HeadLayout, pad_token_id: int) -> np.ndarray:
        """Option logits ``[questions, max_options]`` (float32, ``-inf`` padding) for right-padded ``records``."""
        input_ids, attention_mask = collate(records, pad_token_id, self.device)
        hidden = self.hidden_states(input_ids, attention_mask)
        device_layout = layout.map(lambda a: torch.from_numpy(a).to(self.device))
        lexical = self.output_embedding.index_select(0, device_layout.option_token_ids)
        logits = self.head(hidden, attention_mask, lexical, device_layout)
        return logits.float().cpu().numpy()

    def describe(self) -> dict[str, Any]:
        params = sum(p.numel() for p in self.model.parameters())
        head_params = sum(p.numel() for p in self.head.parameters())
        return {"backend": self.name, "device": str(self.device), "backbone_dtype": str(self.dtype).split(".")[-1],
                "backbone_parameters": params, "head_parameters": head_params, "head_dtype": "float32"}


def collate(records: list[EncodedRecord], pad_token_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Right-padded ``input_ids`` and ``attention_mask`` (1 on real tokens)."""
    length = max(len(r.input_ids) for r in records)
    ids = np.full((len(records), length), pad_token_id, dtype=np.int64)
    mask = np.zeros((len(records), length), dtype=np.int64)
    for i, record in enumerate(records):
        ids[i, : len(record.input_ids)] = record.input_ids
        mask[i, : len(record.input_ids)] = 1
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)
