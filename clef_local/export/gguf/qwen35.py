"""The ``qwen3_5`` converter (Clef, Clef-flash, tiny Qwen3.5 releases): llama.cpp's ``Qwen3_5TextModel`` of
``convert_hf_to_gguf.py`` with ``--no-mtp``, the text model only (no vision tower: images stay on torch, no MTP).

Transforms, as llama.cpp's converter applies them (``conversion/qwen.py``): every RMSNorm weight + 1 (Qwen3.5's norms
scale by ``1 + w``) except the gated-delta-net's ``linear_attn.norm``; ``A_log`` → ``-exp(A_log)``; ``dt_bias`` →
``ssm_dt.bias``; the conv1d kernel squeezed to ``[channels, kernel]``; and when a linear-attention layer has more
value heads than key heads, the value heads reordered from grouped-by-key-head to tiled order (the V rows of
``in_proj_qkv``, the rows of ``in_proj_z`` / ``in_proj_a`` / ``in_proj_b``, ``A_log``, ``dt_bias``, the V channels of
the conv kernel and the columns of ``out_proj``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from clef_local.errors import ReleaseError
from clef_local.export.gguf.plan import Converter, TensorPlan, layer_pattern, text_parameters

TEXT_PREFIX = "model.language_model."
LAYER = layer_pattern(TEXT_PREFIX, r"(.+)")
SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")  # the vision tower, multi-token prediction
GLOBAL_NAMES = {f"{TEXT_PREFIX}embed_tokens.weight": "token_embd.weight", f"{TEXT_PREFIX}norm.weight":
                "output_norm.weight", "lm_head.weight": "output.weight"}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
DEFAULT_MROPE_SECTION = [11, 11, 10, 0]  # llama.cpp's _Qwen35MRopeMixin: the loader requires the key


def reorder_v_heads(tensor: np.ndarray, axis: int, num_k_heads: int, num_v_per_k: int, head_dim: int) -> np.ndarray:
    """llama.cpp's ``_reorder_v_heads``: along ``axis``, value heads grouped by key head ``[G0_v0..v{r-1}, G1_…]``
    → tiled ``[G0_v0, G1_v0, …, G0_v1, …]`` (ggml broadcasts key heads that way)."""
    axis %= tensor.ndim
    shape = list(tensor.shape)
    grouped = tensor.reshape(*shape[:axis], num_k_heads, num_v_per_k, head_dim, *shape[axis + 1:])
    return np.swapaxes(grouped, axis, axis + 1).reshape(shape)


def _plus_one(values: np.ndarray) -> np.ndarray:
    return values + 1


def _transform(part: str, hparams: dict[str, Any]) -> Callable[[np.ndarray], np.ndarray] | None:
    """The transform of the layer tensor ``part`` (its name after ``layers.N.``), composed as llama.cpp applies
    them: the V-head reorder first (``_LinearAttentionVReorderBase``), then ``Qwen3NextModel``'s."""
    if part.endswith("norm.weight") and part != "linear_attn.norm.weight":
        return _plus_one
    if not part.startswith("linear_attn."):
        return None
    n_k, n_v = int(hparams["linear_num_key_heads"]), int(hparams["linear_num_value_heads"])
    k_dim, v_dim = int(hparams["linear_key_head_dim"]), int(hparams["linear_value_head_dim"])
    reorder = n_k != n_v
    r = n_v // n_k

    def qkv(w: np.ndarray) -> np.ndarray:
        qk = 2 * n_k * k_dim
        return np.concatenate([w[:qk], reorder_v_heads(w[qk:], 0, n_k, r, v_dim)])

    def conv(w: np.ndarray) -> np.ndarray:
        w = w.squeeze()
        if not reorder:
            return w
        qk = 2 * n_k * k_dim
        return np.concatenate([w[:qk], reorder_v_heads(w[qk:], 0, n_k, r, v_dim)])

    def a_log(w: np.ndarray) -> np.ndarray:
        # in float64, rounded once: the float32 values torch's exp gives llama.cpp's converter (numpy's float32 exp
        # is 1 ulp off on some)
        w = reorder_v_heads(w, 0, n_k, r, 1) if reorder else w
        return (-np.exp(w.astype(np.float64))).astype(np.float32)

    transforms: dict[str, Callable[[np.ndarray], np.ndarray]] = {
        "linear_attn.A_log": a_log, "linear_attn.conv1d.weight": conv}
    if reorder:
        transforms.update({
            "linear_attn.in_proj_qkv.weight": qkv,
            "linear_attn.in_proj_z.weight": lambda w: reorder_v_heads(w, 0, n_k, r, v_dim),
            "linear_attn.in_proj_a.weight": lambda w: reorder_v_heads(w, 0, n_k, r, 1),
            "linear_attn.in_proj_b.weight": lambda w: reorder_v_heads(w, 0, n_k, r, 1),
            "linear_attn.dt_bias": lambda w: reorder_v_heads(w, 0, n_k, r, 1),
            "linear_attn.out_proj.weight": lambda w: reorder_v_heads(w, 1, n_k, r, v_dim),
        })
    return transforms.get(part)


def _columns(part: str, hparams: dict[str, Any]) -> Callable[[np.ndarray], np.ndarray] | None:
    """The input-column reorder of ``out_proj`` (its columns are value heads), for per-column vectors."""
    if part != "linear_attn.out_proj.weight":
        return None
    n_k, n_v = int(hparams["linear_num_key_heads"]), int(hparams["linear_num_value_heads"])
    if n_k == n_v:
        return None
    v_dim = int(hparams["linear_value_head_dim"])
    return lambda values: reorder_v_heads(values, 0, n_k, n_v // n_k, v_dim)


def plan(hparams: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[TensorPlan]:
    tied = bool(hparams.get("tie_word_embeddings"))
    plans = []
    for name, shape in shapes.items():
        if name.startswith(SKIPPED_PREFIXES) or (tied and name == "lm_head.weight"):
            continue
        transform: Callable[[np.ndarray], np.ndarray] | None = None
        columns: Callable[[np.ndarray], np.ndarray] | None = None
        if name in GLOBAL_NAMES:
            out = GLOBAL_NAMES[name]
            transform = _plus_one if out == "output_norm.weight" else None
        elif (match := LAYER.fullmatch(name)) and match.group(2) in LAYER_NAMES:
            out = f"blk.{match.group(1)}.{LAYER_NAMES[match.group(2)]}"
            transform = _transform(match.group(2), hparams)
            columns = _columns(match.group(2), hparams)
        else:
            raise ReleaseError(f"backbone tensor {name!r} has no GGUF name in the qwen3_5 converter; this release is "
                               f"not a dense Qwen3.5 (convert it with llama.cpp's convert_hf_to_gguf.py)")
        written = tuple(d for d in shape if d != 1) if out.endswith("ssm_conv1d.weight") else tuple(shape)
        plans.append(TensorPlan(name, out, written, transform, columns))
    return plans


def parameters(writer: Any, hparams: dict[str, Any]) -> None:
    """``qwen35.*`` as ``Qwen3_5TextModel.set_gguf_parameters`` writes them without MTP layers."""
    n_head = int(hparams["num_attention_heads"])
    n_layer = int(hparams["num_hidden_layers"])
    text_parameters(writer, hparams)
    rope = dict(hparams.get("rope_parameters") or hparams.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ReleaseError(f"config.json: rope_type {kind!r}; a Qwen3.5 release has default (interleaved MRoPE) rope")
    writer.add_rope_dimension_sections((list(rope.get("mrope_section") or DEFAULT_MROPE_SECTION) + [0] * 4)[:4])
    writer.add_rope_freq_base(float(rope.get("rope_theta", hparams.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(hparams["rms_norm_eps"]))
    head_dim = int(hparams.get("head_dim") or int(hparams["hidden_size"]) // n_head)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_ssm_conv_kernel(int(hparams["linear_conv_kernel_dim"]))
    writer.add_ssm_state_size(int(hparams["linear_key_head_dim"]))
    writer.add_ssm_group_count(int(hparams["linear_num_key_heads"]))
    writer.add_ssm_time_step_rank(int(hparams["linear_num_value_heads"]))
    writer.add_ssm_inner_size(int(hparams["linear_value_head_dim"]) * int(hparams["linear_num_value_heads"]))
    if (layer_types := hparams.get("layer_types")) is not None:
        if len(layer_types) != n_layer:
            raise ReleaseError(f"config.json: layer_types has {len(layer_types)} entries for {n_layer} layers")
        # the key gguf-py's GGUFWriter.add_recurrent_layers writes (newer gguf-py than some installs have)
        writer.add_array(f"{writer.arch}.attention.recurrent_layers", [t == "linear_attention" for t in layer_types])
    writer.add_full_attention_interval(int(hparams.get("full_attention_interval", 4)))
    factor = float(rope.get("partial_rotary_factor", hparams.get("partial_rotary_factor", 0.25)))
    writer.add_rope_dimension_count(int(head_dim * factor))


CONVERTER = Converter("qwen3_5", "qwen35", plan, parameters, torch_prefixes=("model.visual.",))
