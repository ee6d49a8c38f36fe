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
