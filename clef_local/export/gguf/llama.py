"""The ``llama`` converter (the demo model, tiny llama releases): llama.cpp's ``LlamaModel`` of
``convert_hf_to_gguf.py``, for the dense Llama checkpoints a Clef release can hold.

Q and K rows are permuted from Hugging Face's rotate-half layout to llama.cpp's interleaved RoPE (``undo_permute``);
a tied ``lm_head`` is left out (llama.cpp then reads the output rows from ``token_embd``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from clef_local.errors import ReleaseError
from clef_local.export.gguf.plan import Converter, TensorPlan, layer_pattern, text_parameters

PREFIX = "model."
LAYER = layer_pattern(PREFIX, r"(.+)")
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
SKIPPED = (".rotary_emb.inv_freq",)  # buffers some old checkpoints saved (llama.cpp skips them too)
ROPE_TYPES = ("default", "linear")


def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rows from halves (rotate-half) to pairs (interleaved)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def rope(hparams: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters (``rope_parameters``, else ``rope_scaling``, with ``rope_theta`` beside them); a type
    other than :data:`ROPE_TYPES` is refused (llama3 / yarn scaling is not converted here)."""
    params = dict(hparams.get("rope_parameters") or hparams.get("rope_scaling") or {})
    params.setdefault("rope_theta", hparams.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ReleaseError(f"config.json: rope_type {kind!r}; clef-local export-gguf converts {', '.join(ROPE_TYPES)} "
                           f"RoPE (convert other scalings with llama.cpp's convert_hf_to_gguf.py)")
    return params


def plan(hparams: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[TensorPlan]:
    n_head = int(hparams["num_attention_heads"])
    n_kv = int(hparams.get("num_key_value_heads") or n_head)
    tied = bool(hparams.get("tie_word_embeddings"))
    plans = []
    for name, shape in shapes.items():
        transform: Callable[[np.ndarray], np.ndarray] | None = None
        if name.endswith(SKIPPED) or (tied and name == "lm_head.weight"):
            continue
        if name in GLOBAL_NAMES:
            out = GLOBAL_NAMES[name]
        elif (match := LAYER.fullmatch(name)) and match.group(2) in LAYER_NAMES:
            out = f"blk.{match.group(1)}.{LAYER_NAMES[match.group(2)]}"
            if match.group(2) == "self_attn.q_proj.weight":
                transform = partial(permute, n_head=n_head)
            elif match.group(2) == "self_attn.k_proj.weight":
                transform = partial(permute, n_head=n_kv)
        else:
            raise ReleaseError(f"backbone tensor {name!r} has no GGUF name in the llama converter; this release is "
                               f"not a plain Llama (convert it with llama.cpp's convert_hf_to_gguf.py)")
        plans.append(TensorPlan(name, out, tuple(shape), transform))
    return plans


def parameters(writer: Any, hparams: dict[str, Any]) -> None:
    """``llama.*`` as ``LlamaModel.set_gguf_parameters`` writes them."""
    import gguf

    text_parameters(writer, hparams)
    params = rope(hparams)
    if params.get("rope_type", params.get("type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(params["factor"]))
    writer.add_rope_freq_base(float(params["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(hparams["rms_norm_eps"]))
    if (head_dim := hparams.get("head_dim")) is not None:
        writer.add_key_length(int(head_dim))
        writer.add_value_length(int(head_dim))
    writer.add_vocab_size(int(hparams["vocab_size"]))
    writer.add_rope_dimension_count(int(head_dim or int(hparams["hidden_size"]) // int(hparams["num_attention_heads"])))


CONVERTER = Converter("llama", "llama", plan, parameters, space_prefix=True)
