"""Tests of clef_local.testing: the tiny random releases every other test builds on."""

from __future__ import annotations

import hashlib
import json
import runpy
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from clef_local.heads.torch_head import HeadConfig, JointSchemaHead
from clef_local.testing import ADDED_TOKENS, SPECIAL_TOKENS, build_tiny_release

BACKBONES = ("qwen3_5", "llama")
COMMON_FILES = {
    "config.json", "generation_config.json", "joint_head_config.json", "joint_head.safetensors",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "chat_template.jinja", "joint_schema_model.py", "LICENSE", "NOTICE",
}
PROCESSOR_FILES = {"processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json"}
TRICKY_TEXTS = (
    "<|im_start|>system\nRead the complete state.<|im_end|>\n<|im_start|>user\nSTATE:\n",
    '{"option_id":"card_declined","description":"The card payment was declined."}',
    '{"a":[1,2.5,-3e-7,null,true,false],"b":{"c":"d\\"e"}}',
    "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:",
    "café naïve façade — “quotes” ‘single’ … ½ ¼",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 😀🎉👩‍👩‍👧 🇫🇷 ❤️ and more 🤖",
    "ที่นี่ हिन्दी मेरा भाषा ภาษาไทย e\u0301 q\u0301uick Ä",  # merges across combining marks
    "  leading   spaces\t\ttabs\r\nwindows\n\n\nnewlines   ",
    "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>\n",
    "don't I'LL we've it's SHOUTING CamelCase snake_case 1234567890",
    "<|endoftext|>x<|im_end|><|im_end|>y<think>z</think>",
    "",
)


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "qwen3_5": build_tiny_release(root / "qwen3_5", "qwen3_5"),
        "llama": build_tiny_release(root / "llama", "llama", shards=3),
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("backbone", BACKBONES)
def test_layout(releases: dict[str, Path], backbone: str) -> None:
    names = {p.name for p in releases[backbone].iterdir()}
    assert names >= COMMON_FILES
    if backbone == "qwen3_5":
        assert names >= PROCESSOR_FILES
        assert "model.safetensors" in names
        assert json.loads((releases[backbone] / "config.json").read_text())["architectures"] == [
            "Qwen3_5ForConditionalGeneration"
        ]
    head_config = json.loads((releases[backbone] / "joint_head_config.json").read_text())
    assert list(head_config) == ["hidden_size", "width", "routing_layers", "layers", "heads", "feedforward"]
    assert "random" in (releases[backbone] / "NOTICE").read_text().lower()
    assert "Apache" in (releases[backbone] / "LICENSE").read_text()


def test_canary_raises(releases: dict[str, Path]) -> None:
    with pytest.raises(RuntimeError, match="never import"):
        runpy.run_path(str(releases["qwen3_5"] / "joint_schema_model.py"))


def test_refuses_non_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "something").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        build_tiny_release(tmp_path, "llama")
    with pytest.raises(ValueError, match="backbone"):
        build_tiny_release(tmp_path / "new", "gpt2")  # type: ignore[arg-type]


@pytest.mark.parametrize("backbone", BACKBONES)
def test_tokenizer_parity(releases: dict[str, Path], backbone: str) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(releases[backbone])
    raw = Tokenizer.from_file(str(releases[backbone] / "tokenizer.json"))
    assert auto.pad_token == "<|endoftext|>" and auto.eos_token == "<|im_end|>"
    assert len(auto) == raw.get_vocab_size()
    for text in TRICKY_TEXTS:
        ids = raw.encode(text, add_special_tokens=False).ids
        assert auto(text, add_special_tokens=False).input_ids == ids, text
        assert raw.decode(ids, skip_special_tokens=False) == text or "\u0301" in text  # NFC may compose
    chat = auto.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("backbone", BACKBONES)
def test_special_tokens_are_single_ids(releases: dict[str, Path], backbone: str) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(releases[backbone] / "tokenizer.json"))
    vocab_size = json.loads((releases[backbone] / "config.json").read_text()).get("vocab_size") or json.loads(
        (releases[backbone] / "config.json").read_text())["text_config"]["vocab_size"]
    for token in SPECIAL_TOKENS + ADDED_TOKENS:
        token_id = raw.token_to_id(token)
        assert token_id is not None and token_id < vocab_size
        assert raw.encode(f"a{token}b", add_special_tokens=False).ids.count(token_id) == 1
        assert raw.encode(f"x {token}\n", add_special_tokens=False).ids.count(token_id) == 1
    special = {t["content"]: t["special"] for t in json.loads(raw.to_str())["added_tokens"]}
    assert special == {**dict.fromkeys(SPECIAL_TOKENS, True), **dict.fromkeys(ADDED_TOKENS, False)}


def test_qwen_backbone_reloads(releases: dict[str, Path]) -> None:
    from tokenizers import Tokenizer
    from transformers import Qwen3_5ForConditionalGeneration

    path = releases["qwen3_5"]
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    model = Qwen3_5ForConditionalGeneration.from_pretrained(path).eval()
    config = model.config
    assert model.dtype == torch.bfloat16
    assert config.image_token_id == raw.token_to_id("<|image_pad|>")
    assert config.video_token_id == raw.token_to_id("<|video_pad|>")
    assert config.vision_start_token_id == raw.token_to_id("<|vision_start|>")
    assert config.vision_end_token_id == raw.token_to_id("<|vision_end|>")
    assert config.text_config.eos_token_id == raw.token_to_id("<|im_end|>")
    assert config.text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size == 64
    assert model.lm_head.weight.shape[0] >= raw.get_vocab_size()
    assert model.lm_head.weight.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr()
    _check_hidden_states(model.model.language_model, raw)


def test_llama_backbone_reloads(releases: dict[str, Path]) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    path = releases["llama"]
    raw_config = json.loads((path / "config.json").read_text())
    assert raw_config["rope_theta"] == raw_config["rope_parameters"]["rope_theta"] == 100000.0
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.bfloat16
    assert model.config.rope_parameters["rope_theta"] == 100000.0
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    _check_hidden_states(model.model, Tokenizer.from_file(str(path / "tokenizer.json")))


def _check_hidden_states(text_model: torch.nn.Module, raw: object) -> None:
    texts = ['{"option_id":"true","description":"yes"}', "STATE: the card was declined 😀, twice!!"]
    encoded = [raw.encode(t, add_special_tokens=False).ids[:8] for t in texts]  # type: ignore[attr-defined]
    with torch.no_grad():
        hidden = text_model(input_ids=torch.tensor(encoded), use_cache=False).last_hidden_state.float()
    assert torch.isfinite(hidden).all()
    assert hidden.std() > 0.1
    cosine = torch.nn.functional.cosine_similarity(hidden[0], hidden[1], dim=-1)
    assert cosine.mean() < 0.9  # different inputs give meaningfully different states


@pytest.mark.parametrize("backbone", BACKBONES)
def test_head_loads_strictly(releases: dict[str, Path], backbone: str) -> None:
    path = releases[backbone]
    config = HeadConfig(**json.loads((path / "joint_head_config.json").read_text()))
    assert config.hidden_size == 64
    state = load_file(path / "joint_head.safetensors")
    assert all(t.dtype == torch.float32 for t in state.values())
    head = JointSchemaHead(config)
    head.load_state_dict(state, strict=True)
    for name in ("prior_logit_scale", "joint_logit_scale"):
        assert 0.5 <= state[name].item() <= 2.0
    assert abs(state["residual_gate"].item()) >= 0.3
    for name, tensor in state.items():
        assert tensor.abs().sum() > 0, name
        if "norm" in name and name.endswith("weight"):
            assert not torch.allclose(tensor, torch.ones_like(tensor)), name


def test_custom_head_hidden_size_is_forced(tmp_path: Path) -> None:
    custom = HeadConfig(hidden_size=999, width=16, routing_layers=2, layers=1, heads=2, feedforward=32)
    path = build_tiny_release(tmp_path / "r", "llama", head_config=custom)
    written = json.loads((path / "joint_head_config.json").read_text())
    assert written == {"hidden_size": 64, "width": 16, "routing_layers": 2, "layers": 1, "heads": 2,
                       "feedforward": 32}
    JointSchemaHead(HeadConfig(**written)).load_state_dict(load_file(path / "joint_head.safetensors"))


@pytest.mark.parametrize("backbone", BACKBONES)
def test_shards(releases: dict[str, Path], tmp_path: Path, backbone: str) -> None:
    path = releases["llama"] if backbone == "llama" else build_tiny_release(tmp_path / "q", backbone, shards=3)
    files = sorted(p.name for p in path.glob("model*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    stored: dict[str, str] = {}
    for name in files:
        with safe_open(path / name, "pt") as f:
            stored.update(dict.fromkeys(f.keys(), name))
    assert index["weight_map"] == stored
    assert set(index["weight_map"].values()) == set(files)
    if backbone == "qwen3_5":
        from transformers import Qwen3_5ForConditionalGeneration

        Qwen3_5ForConditionalGeneration.from_pretrained(path)


def test_deterministic(releases: dict[str, Path], tmp_path: Path) -> None:
    again = build_tiny_release(tmp_path / "again", "qwen3_5", seed=0)
    other = build_tiny_release(tmp_path / "other", "qwen3_5", seed=1)
    for name in ("model.safetensors", "joint_head.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(again / name) == _sha256(releases["qwen3_5"] / name), name
    assert _sha256(other / "model.safetensors") != _sha256(again / "model.safetensors")
    assert _sha256(other / "joint_head.safetensors") != _sha256(again / "joint_head.safetensors")
    llama = build_tiny_release(tmp_path / "llama", "llama", shards=3)
    for shard in sorted(llama.glob("model-*.safetensors")):
        assert _sha256(shard) == _sha256(releases["llama"] / shard.name)


def test_real_text_keys_match_the_packaged_clef_flash_config() -> None:
    """The tiny Qwen release copies the unshrunk keys of Clef-flash's packaged text config verbatim."""
    from clef_local.planning.planner import packaged_config
    from clef_local.testing import _REAL_TEXT

    text = json.loads(packaged_config("clef-flash").read_text(encoding="utf-8"))["text_config"]
    assert {key: text[key] for key in _REAL_TEXT} == _REAL_TEXT
