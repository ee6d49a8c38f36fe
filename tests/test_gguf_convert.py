"""The GGUF converter (clef_local.export.gguf.convert) read back with gguf-py: tensor names, shapes and types as
llama.cpp's convert_hf_to_gguf.py writes them, every transform checked numerically against the safetensors, the
metadata llama.cpp's loader reads, and the vocabulary with the tokenizer's ids. No llama.cpp needed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from clef_local.errors import ReleaseError
from clef_local.export.gguf.convert import write_gguf
from clef_local.export.gguf.qwen35 import reorder_v_heads
from clef_local.export.gguf.vocab import CONTROL, NORMAL, UNUSED, USER_DEFINED, pre_tokenizer_name
from clef_local.formats.release import read_release
from clef_local.formats.safetensors import read_numpy


@pytest.fixture(scope="module")
def converted(tiny_llama: Path, tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf")
    files = {}
    for name, src in (("llama", tiny_llama), ("qwen", tiny_qwen)):
        for ftype in ("F32", "F16", "BF16"):
            files[f"{name}-{ftype}"] = out / f"{name}-{ftype}.gguf"
            write_gguf(read_release(src), files[f"{name}-{ftype}"], ftype,
                       output_type=None if ftype == "F32" else "BF16")
    return files


def _tensors(path: Path) -> dict[str, object]:
    return {t.name: t for t in GGUFReader(path).tensors}


def _field(path: Path, key: str) -> object:
    field = GGUFReader(path).get_field(key)
    return None if field is None else field.contents()


def _values(tensor: object) -> np.ndarray:
    data = np.asarray(tensor.data)  # type: ignore[attr-defined]
    if tensor.tensor_type.name == "BF16":  # type: ignore[attr-defined]
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(
            tuple(reversed([int(d) for d in tensor.shape])))  # type: ignore[attr-defined]
    return data.astype(np.float32)


def test_llama_names_shapes_and_transforms(converted: dict[str, Path], tiny_llama: Path) -> None:
    source = read_numpy(tiny_llama / "model.safetensors")
    config = json.loads((tiny_llama / "config.json").read_text())
    tensors = _tensors(converted["llama-F32"])
    layers = config["num_hidden_layers"]
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(layers) for n in
        ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
    assert set(tensors) == expected  # tied: no output.weight, llama.cpp reads the rows from token_embd
    assert all(t.tensor_type.name == "F32" for t in tensors.values())
    np.testing.assert_array_equal(_values(tensors["token_embd.weight"]), source["model.embed_tokens.weight"])
    assert [int(d) for d in tensors["token_embd.weight"].shape] == [64, source["model.embed_tokens.weight"].shape[0]]
    np.testing.assert_array_equal(_values(tensors["blk.1.ffn_down.weight"]),
                                  source["model.layers.1.mlp.down_proj.weight"])
    # Q and K: each head's rows from halves (rotate-half) to interleaved pairs
    for proj, heads in (("q", config["num_attention_heads"]), ("k", config["num_key_value_heads"])):
        w = source[f"model.layers.0.self_attn.{proj}_proj.weight"]
        got = _values(tensors[f"blk.0.attn_{proj}.weight"])
        half = w.shape[0] // heads // 2
        for h in range(heads):
            for j in range(half):
                np.testing.assert_array_equal(got[h * 2 * half + 2 * j], w[h * 2 * half + j])
                np.testing.assert_array_equal(got[h * 2 * half + 2 * j + 1], w[h * 2 * half + half + j])
    np.testing.assert_array_equal(_values(tensors["blk.0.attn_norm.weight"]),
                                  source["model.layers.0.input_layernorm.weight"])  # llama: no +1


def test_qwen_text_only_and_transforms(converted: dict[str, Path], tiny_qwen: Path) -> None:
    source = read_numpy(tiny_qwen / "model.safetensors")
    text = json.loads((tiny_qwen / "config.json").read_text())["text_config"]
    tensors = _tensors(converted["qwen-F32"])
    prefix = "model.language_model."
    assert not any("visual" in n or "mtp" in n for n in tensors)
    assert "output.weight" in tensors  # not tied
    n_text = sum(1 for n in source if n.startswith(prefix)) + 1  # + lm_head
    assert len(tensors) == n_text
    np.testing.assert_array_equal(_values(tensors["output.weight"]), source["lm_head.weight"])
    # RMSNorm weights + 1, except the gated-delta-net's norm
    np.testing.assert_allclose(_values(tensors["output_norm.weight"]), source[f"{prefix}norm.weight"] + 1, rtol=0)
    np.testing.assert_allclose(_values(tensors["blk.3.attn_q_norm.weight"]),
                               source[f"{prefix}layers.3.self_attn.q_norm.weight"] + 1, rtol=0)
    np.testing.assert_allclose(_values(tensors["blk.0.post_attention_norm.weight"]),
                               source[f"{prefix}layers.0.post_attention_layernorm.weight"] + 1, rtol=0)
    np.testing.assert_array_equal(_values(tensors["blk.0.ssm_norm.weight"]),
                                  source[f"{prefix}layers.0.linear_attn.norm.weight"])
    # 2 key heads, 4 value heads: value heads reordered from grouped to tiled
    n_k, n_v = text["linear_num_key_heads"], text["linear_num_value_heads"]
    k_dim, v_dim = text["linear_key_head_dim"], text["linear_value_head_dim"]
    assert n_k != n_v
    la = f"{prefix}layers.0.linear_attn."
    order = [g * (n_v // n_k) + j for j in range(n_v // n_k) for g in range(n_k)]  # tiled: G0v0, G1v0, G0v1, ...
    a = source[la + "A_log"]
    np.testing.assert_allclose(_values(tensors["blk.0.ssm_a"]), -np.exp(a[order].astype(np.float64)), rtol=1e-7)
    np.testing.assert_array_equal(_values(tensors["blk.0.ssm_dt.bias"]), source[la + "dt_bias"][order])
    np.testing.assert_array_equal(_values(tensors["blk.0.ssm_alpha.weight"]), source[la + "in_proj_a.weight"][order])
    qkv = source[la + "in_proj_qkv.weight"]
    qk = 2 * n_k * k_dim
    v_rows = qkv[qk:].reshape(n_v, v_dim, -1)[order].reshape(n_v * v_dim, -1)
    np.testing.assert_array_equal(_values(tensors["blk.0.attn_qkv.weight"]), np.concatenate([qkv[:qk], v_rows]))
    z = source[la + "in_proj_z.weight"].reshape(n_v, v_dim, -1)[order].reshape(n_v * v_dim, -1)
    np.testing.assert_array_equal(_values(tensors["blk.0.attn_gate.weight"]), z)
    out = source[la + "out_proj.weight"]
    cols = out.reshape(out.shape[0], n_v, v_dim)[:, order].reshape(out.shape)
    np.testing.assert_array_equal(_values(tensors["blk.0.ssm_out.weight"]), cols)
    conv = source[la + "conv1d.weight"][:, 0, :]  # [channels, 1, kernel] -> [channels, kernel]
    conv_v = conv[qk:].reshape(n_v, v_dim, -1)[order].reshape(n_v * v_dim, -1)
    assert [int(d) for d in tensors["blk.0.ssm_conv1d.weight"].shape] == [text["linear_conv_kernel_dim"], conv.shape[0]]
    np.testing.assert_array_equal(_values(tensors["blk.0.ssm_conv1d.weight"]), np.concatenate([conv[:qk], conv_v]))


def test_reorder_is_llama_cpps() -> None:
    """The reorder on index arrays: grouped [G0v0 G0v1 G1v0 G1v1] -> tiled [G0v0 G1v0 G0v1 G1v1]."""
    rows = np.arange(4 * 3).reshape(12, 1)  # 2 key heads x 2 value heads x head_dim 3
    got = reorder_v_heads(rows, 0, 2, 2, 3)[:, 0]
    assert got.tolist() == [0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11]


def test_float_types_follow_llama_cpp(converted: dict[str, Path], tiny_qwen: Path) -> None:
    source = read_numpy(tiny_qwen / "model.safetensors")
    for ftype in ("F16", "BF16"):
        tensors = _tensors(converted[f"qwen-{ftype}"])
        for name, tensor in tensors.items():
            kept = (name.endswith("_norm.weight") or ".ssm_conv1d." in name or not name.endswith(".weight")
                    or len(tensor.shape) == 1)
            want = "F32" if kept else "BF16" if name == "output.weight" else ftype
            assert tensor.tensor_type.name == want, (ftype, name)
        assert _field(converted[f"qwen-{ftype}"], "general.file_type") == {"F16": 1, "BF16": 32}[ftype]
    bf16 = _tensors(converted["qwen-BF16"])
    # BF16 from a BF16 release: the stored bits, exactly
    np.testing.assert_array_equal(_values(bf16["token_embd.weight"]),
                                  source["model.language_model.embed_tokens.weight"])
    f16 = _tensors(converted["qwen-F16"])
    np.testing.assert_allclose(_values(f16["blk.0.ffn_up.weight"]),
                               source["model.language_model.layers.0.mlp.up_proj.weight"], rtol=1e-3, atol=1e-6)


def test_metadata_llama_cpp_reads(converted: dict[str, Path], tiny_qwen: Path, tiny_llama: Path) -> None:
    q, text = converted["qwen-F32"], json.loads((tiny_qwen / "config.json").read_text())["text_config"]
    assert _field(q, "general.architecture") == "qwen35"
    expect = {"qwen35.block_count": 4, "qwen35.embedding_length": 64, "qwen35.feed_forward_length": 128,
              "qwen35.attention.head_count": 4, "qwen35.attention.head_count_kv": 2, "qwen35.attention.key_length": 16,
              "qwen35.ssm.conv_kernel": 4, "qwen35.ssm.state_size": 16, "qwen35.ssm.group_count": 2,
              "qwen35.ssm.time_step_rank": 4, "qwen35.ssm.inner_size": 64, "qwen35.full_attention_interval": 4,
              "qwen35.rope.dimension_count": 8, "qwen35.context_length": text["max_position_embeddings"]}
    for key, value in expect.items():
        assert _field(q, key) == value, key
    assert _field(q, "qwen35.rope.dimension_sections") == [2, 1, 1, 0]
    assert _field(q, "qwen35.attention.recurrent_layers") == [True, True, True, False]
    assert _field(q, "tokenizer.ggml.pre") == "qwen35"
    lm = converted["llama-F32"]
    assert _field(lm, "llama.rope.freq_base") == 100000.0
    assert _field(lm, "llama.rope.dimension_count") == 16
    assert _field(lm, "llama.vocab_size") == json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    assert _field(lm, "tokenizer.ggml.pre") == "qwen2"  # the tiny llama release splits with Qwen2's regex


def test_vocab_keeps_every_id(converted: dict[str, Path], tiny_qwen: Path) -> None:
    tok = json.loads((tiny_qwen / "tokenizer.json").read_text())
    vocab_size = json.loads((tiny_qwen / "config.json").read_text())["text_config"]["vocab_size"]
    path = converted["qwen-F32"]
    tokens, types = _field(path, "tokenizer.ggml.tokens"), _field(path, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == vocab_size
    for token, i in tok["model"]["vocab"].items():
        assert tokens[i] == token and types[i] == NORMAL
    for added in tok["added_tokens"]:
        assert tokens[added["id"]] == added["content"]
        assert types[added["id"]] == (CONTROL if added["special"] else USER_DEFINED)
    ids = {i for i in tok["model"]["vocab"].values()} | {t["id"] for t in tok["added_tokens"]}
    assert all(types[i] == UNUSED and tokens[i] == f"[PAD{i}]" for i in range(vocab_size) if i not in ids)
    im_end = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|im_end|>")
    assert _field(path, "tokenizer.ggml.eos_token_id") == im_end
    merges = _field(path, "tokenizer.ggml.merges")
    assert len(merges) == len(tok["model"]["merges"])


def test_pre_tokenizer_names() -> None:
    smollm = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                    {"type": "ByteLevel", "add_prefix_space": False,
                                                     "use_regex": True}]}
    assert pre_tokenizer_name(smollm) == "smollm"  # the demo model's (SmolLM2)
    assert pre_tokenizer_name({"type": "Whitespace"}) == "default"


def test_unknown_tensor_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    from clef_local.export.gguf.llama import plan

    config = json.loads((tiny_llama / "config.json").read_text())
    with pytest.raises(ReleaseError, match=r"'model.layers.0.self_attn.rotary_extra.weight' has no GGUF name"):
        plan(config, {"model.layers.0.self_attn.rotary_extra.weight": (4,)})


def test_row_blocks_write_the_same_bytes(converted: dict[str, Path], tiny_qwen: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A large tensor is written in row blocks (never whole in memory): with blocks of a few rows the bytes are
    those of one block, for a copy at the source precision (BF16) and for a conversion (F16)."""
    from clef_local.export.gguf import convert

    monkeypatch.setattr(convert, "_BLOCK_BYTES", 300)  # 1-2 rows of 64 values a block
    for ftype in ("BF16", "F16"):
        out = tmp_path / f"blocks-{ftype}.gguf"
        write_gguf(read_release(tiny_qwen), out, ftype, output_type="BF16")
        assert out.read_bytes() == converted[f"qwen-{ftype}"].read_bytes()
