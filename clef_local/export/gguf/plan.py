"""What a GGUF converter is (clef_local.export.gguf.convert): the tensors it writes (:class:`TensorPlan`), one
converter per release backbone (:class:`Converter`), and llama.cpp's converter rules they share."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TensorPlan:
    """One GGUF tensor: its safetensors ``source``, its GGUF ``name``, its numpy-order ``shape`` as written (GGUF
    stores the dimensions reversed) and the ``transform`` applied to the float32 source (None: the values as they
    are, converted in row blocks); ``columns``: how the transform reorders the input columns of a weight, applied to
    a per-column vector (the importance matrix, :mod:`.imatrix`; None: columns kept in place)."""

    source: str
    name: str
    shape: tuple[int, ...]
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    columns: Callable[[np.ndarray], np.ndarray] | None = None


@dataclass(frozen=True)
class Converter:
    """How one release backbone becomes one llama.cpp architecture: ``plan`` maps the text config and the source
    tensors (``{name: shape}``) to :class:`TensorPlan` entries (a tensor it does not know is an error, one it skips on
    purpose — a vision tower, MTP layers — is left out); ``parameters`` adds the ``<arch>.*`` keys to a writer."""

    backbone: str
    arch: str
    plan: Callable[[dict[str, Any], dict[str, tuple[int, ...]]], list[TensorPlan]]
    parameters: Callable[[Any, dict[str, Any]], None]
    # LlamaModel.set_vocab writes tokenizer_config.json's add_prefix_space as tokenizer.ggml.add_space_prefix
    space_prefix: bool = False
    # source tensors that stay on torch beside the GGUF (a vision tower), copied byte for byte
    torch_prefixes: tuple[str, ...] = ()


def keeps_float32(name: str, shape: tuple[int, ...]) -> bool:
    """llama.cpp's converter rule: 1-D tensors, norms, the SSM convolution and every tensor not named ``*.weight``
    (``ssm_a``, ``*.bias``) stay F32 whatever the file type."""
    return (len(shape) <= 1 or name.endswith("_norm.weight") or ".ssm_conv1d." in name
            or not name.endswith(".weight"))


def layer_pattern(prefix: str, body: str) -> re.Pattern[str]:
    """``{prefix}layers.{N}.{body}`` with N captured (``body`` is a regex)."""
    return re.compile(rf"{re.escape(prefix)}layers\.(\d+)\.{body}")


def text_parameters(writer: Any, hparams: dict[str, Any]) -> None:
    """The keys every text model writes (llama.cpp's ``TextModel.set_gguf_parameters``): blocks, context, widths and
    head counts; each architecture's ``parameters`` adds its own after them."""
    n_head = int(hparams["num_attention_heads"])
    writer.add_block_count(int(hparams["num_hidden_layers"]))
    if (n_ctx := hparams.get("max_position_embeddings")) is not None:
        writer.add_context_length(int(n_ctx))
    writer.add_embedding_length(int(hparams["hidden_size"]))
    writer.add_feed_forward_length(int(hparams["intermediate_size"]))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(int(hparams.get("num_key_value_heads") or n_head))
