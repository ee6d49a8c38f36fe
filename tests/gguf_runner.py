"""A minimal llama.cpp run for the GGUF export tests: per-token hidden states of one sequence through the low-level
API (embeddings on, pooling NONE, one sequence, an F32 KV cache), as the issue's parity check prescribes. The
library's backend is ``--backend llamacpp`` (clef_local/backends/llamacpp_backend.py); this keeps the export's tests
independent of it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def hidden_states(path: Path, token_ids: Sequence[int], *, threads: int = 1) -> np.ndarray:
    """``[len(token_ids), n_embd]`` float32: the final (normed) hidden state of every token, one decode."""
    from clef_local.backends.llamacpp_log import llama_cpp_module

    L = llama_cpp_module()  # its log to Python logging (the load logs hundreds of lines), as everywhere
    params = L.llama_model_default_params()
    params.n_gpu_layers = 0
    model = L.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    try:
        n = len(token_ids)
        cparams = L.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = max(n, 32)
        cparams.n_seq_max = 1
        cparams.embeddings = True
        cparams.pooling_type = L.LLAMA_POOLING_TYPE_NONE
        cparams.type_k = cparams.type_v = L.GGML_TYPE_F32
        # flash attention rounds the mask and the softmax's inputs to F16 on a CPU: off for an exact comparison
        cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.n_threads = cparams.n_threads_batch = threads
        ctx = L.llama_init_from_model(model, cparams)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        try:
            batch = L.llama_batch_init(n, 0, 1)
            try:
                for i, token in enumerate(token_ids):
                    batch.token[i] = int(token)
                    batch.pos[i] = i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = True
                batch.n_tokens = n
                if (rc := L.llama_decode(ctx, batch)) != 0:
                    raise RuntimeError(f"llama_decode returned {rc}")
                width = L.llama_model_n_embd(model)
                pointer = L.llama_get_embeddings(ctx)
                return np.ctypeslib.as_array(pointer, shape=(n * width,)).reshape(n, width).copy()
            finally:
                L.llama_batch_free(batch)
        finally:
            L.llama_free(ctx)
    finally:
        L.llama_model_free(model)


def torch_hidden_states(release_dir: Path, token_ids: Sequence[int]) -> np.ndarray:
    """The same through clef-local's torch backbone in float32 (the reference)."""
    import torch

    from clef_local.backends.torch_backend import TorchBackbone
    from clef_local.formats.release import read_release

    release = read_release(release_dir)
    backbone = TorchBackbone(release.path, release.config, dtype=torch.float32, weight_files=release.weight_files)
    ids = torch.tensor([list(token_ids)])
    return backbone.forward(ids, torch.ones_like(ids))[0].float().numpy()
