"""Hidden states of one token sequence two ways, for the GGUF tests: through llama.cpp (the library's own
:class:`~clef_local.backends.llamacpp_context.LlamaCppContext` with an F32 KV cache and flash attention off, as the
parity check prescribes) and through clef-local's torch backbone in float32 (the reference)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def hidden_states(path: Path, token_ids: Sequence[int]) -> np.ndarray:
    """``[len(token_ids), n_embd]`` float32: the final (normed) hidden state of every token, llama.cpp in one decode."""
    from clef_local.backends.llamacpp_context import LlamaCppContext

    context = max(len(token_ids), 32)
    with LlamaCppContext(path, context=context, chunk=context, kv_type="f32") as ctx:
        return ctx.hidden_states(token_ids)


def torch_hidden_states(release_dir: Path, token_ids: Sequence[int]) -> np.ndarray:
    """The same through clef-local's torch backbone in float32."""
    import torch

    from clef_local.backends.torch_backend import TorchBackbone
    from clef_local.formats.release import read_release

    release = read_release(release_dir)
    backbone = TorchBackbone(release.path, release.config, dtype=torch.float32, weight_files=release.weight_files)
    ids = torch.tensor([list(token_ids)])
    return backbone.forward(ids, torch.ones_like(ids))[0].float().numpy()
