"""int4 embeddings, as mlx-lm writes them: dequantized once at load on the torch backend.

``mlx_lm.convert -q`` quantizes every module that has a quantized form, ``nn.Embedding`` included, so its
``embed_tokens`` (and an untied ``lm_head``) arrive as ``weight`` uint32 / ``scales`` / ``biases`` in the MLX affine
layout (:mod:`clef_local.quant.int4`). clef-local's own variants keep embeddings as released. The torch backend
gathers embedding rows and reads the output embedding's option rows, both from a float matrix: the stored int4 is
dequantized into the compute dtype when the weights are assigned (the exact ``scales · q + biases``), which costs
the matrix's full-precision size in memory (on Clef 27B, 248k × 5120 in bf16: 2.5 GB instead of 0.7 GB).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from clef_local.errors import ReleaseError
from clef_local.quant import int4, registry

log = logging.getLogger(__name__)
PARTS = ("weight", "scales", "biases")


def embedding_prefixes(model: nn.Module, prefixes: Mapping[str, str]) -> set[str]:
    """The paths of ``prefixes`` (path → scheme, from the headers) that are ``model``'s embeddings (its
    ``nn.Embedding`` modules and its output embedding, ``lm_head``), stored as int4; any other scheme there is a
    ReleaseError naming it."""
    found = set()
    for prefix, scheme in prefixes.items():
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            continue  # swap_linears names it
        if isinstance(module, nn.Embedding) or module is model.get_output_embeddings():
            if not registry.get(scheme).quantized_embeddings:
                raise ReleaseError(f"{prefix} is an embedding stored as {scheme}; clef-local reads quantized "
                                   f"embeddings in int4 (mlx-lm's affine layout) only")
            found.add(prefix)
    return found


def dequantize_embeddings(state: dict[str, torch.Tensor], prefixes: Iterable[str], dtype: torch.dtype) -> None:
    """Replace, in ``state`` (one weight file's tensors), each int4 embedding's ``weight``/``scales``/``biases``
    by its dequantized ``weight`` in ``dtype``; the group size is the stored shapes' (``in / scales columns``)."""
    for prefix in prefixes:
        present = [part for part in PARTS if f"{prefix}.{part}" in state]
        if not present:
            continue
        if len(present) != len(PARTS):
            raise ReleaseError(f"{prefix}: {', '.join(present)} in one weight file without "
                               f"{', '.join(p for p in PARTS if p not in present)}; an int4 embedding's three tensors "
                               f"must be stored together")
        packed = {part: state.pop(f"{prefix}.{part}") for part in PARTS}
        in_features = packed["weight"].shape[1] * int4.PACK
        group = in_features // packed["scales"].shape[1]
        log.info("dequantizing the int4 embedding %s (%d × %d, group %d) to %s", prefix, packed["weight"].shape[0],
                 in_features, group, dtype)
        state[f"{prefix}.weight"] = int4.dequantize(packed, group, dtype)
