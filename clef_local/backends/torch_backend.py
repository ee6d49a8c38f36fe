"""The PyTorch backend: the backbone's text model through ``transformers``, the head in float32.

Real Clef releases are ``Qwen3_5ForConditionalGeneration`` (text model + vision tower); any Hugging Face causal
LM (Llama, Qwen3, ...) works as a backbone too, which is what small test and demo releases use.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from clef_local.errors import ReleaseError
from clef_local.layout import HeadLayout
from clef_local.release import QWEN3_5, Release, load_head

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


class TorchBackbone:
    """A release's backbone through ``transformers``: final hidden states and output-embedding rows."""

    def __init__(self, path: Path, config: dict[str, Any], *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        import transformers

        qwen3_5 = config.get("model_type") == "qwen3_5" or QWEN3_5 in (config.get("architectures") or [])
        cls = transformers.Qwen3_5ForConditionalGeneration if qwen3_5 else transformers.AutoModelForCausalLM
        log.info("loading %s backbone from %s in %s", cls.__name__, path, dtype)
        try:
            model = cls.from_pretrained(path, dtype=dtype, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ReleaseError(f"{path}: the backbone cannot be loaded ({exc})") from exc
        model.config.use_cache = False
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = model.to(self.device).eval()
        base = self.model.model
        # Without media only the text model runs (DESIGN §2.2); with a vision tower it sits beside it.
        self.text_model = getattr(base, "language_model", base)
        self.output_embedding = self.model.get_output_embeddings().weight

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The text model's final (normed) hidden states, ``[B, T, hidden]``."""
        out = self.text_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                              return_dict=True)
        return out.last_hidden_state


class TorchBackend:
    """Runs the backbone and the head for a padded batch of encoded records."""

    name = "torch"

    def __init__(self, release: Release, *, device: str = "cpu", dtype: str | torch.dtype | None = None) -> None:
        self.release = release
        self.backbone = TorchBackbone(release.path, release.config, device=device,
                                      dtype=resolve_dtype(dtype, release))
        self.device = self.backbone.device
        self.head = load_head(release, device=self.device)

    @property
    def output_embedding(self) -> torch.Tensor:
        return self.backbone.output_embedding

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.backbone.hidden_states(input_ids, attention_mask)

    @torch.inference_mode()
    def logits(self, records: list[EncodedRecord], layout: HeadLayout, pad_token_id: int) -> np.ndarray:
        """Option logits ``[questions, max_options]`` (float32, ``-inf`` padding) for right-padded ``records``."""
        input_ids, attention_mask = collate(records, pad_token_id, self.device)
        hidden = self.backbone.hidden_states(input_ids, attention_mask)
        device_layout = layout.map(lambda a: torch.from_numpy(a).to(self.device))
        lexical = self.output_embedding.index_select(0, device_layout.option_token_ids)
        logits = self.head(hidden, attention_mask, lexical, device_layout)
        return logits.float().cpu().numpy()

    def describe(self) -> dict[str, Any]:
        params = sum(p.numel() for p in self.backbone.model.parameters())
        head_params = sum(p.numel() for p in self.head.parameters())
        return {"backend": self.name, "device": str(self.device),
                "backbone_dtype": str(self.backbone.dtype).split(".")[-1],
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
