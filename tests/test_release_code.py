"""A release never runs code: ``auto_map`` is refused at read time, transformers is told ``trust_remote_code=False``
everywhere a release is read, and the tokenizer class is one the format allows (docs/format.md §1)."""

from __future__ import annotations

import builtins
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import clef_local
from clef_local.errors import ReleaseError
from clef_local.formats.release import TOKENIZER_CLASSES, read_release
from clef_local.runtime.tokenizer import ReleaseTokenizer

EVIL_CODE = """
from pathlib import Path
Path({marker!r}).write_text("the release's code ran")
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
class EvilConfig(LlamaConfig):
    model_type = "evil"
class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data), encoding="utf-8")


def _evil_release(tiny_llama: Path, root: Path, where: str) -> tuple[Path, Path]:
    """A copy of the tiny llama release carrying ``evil.py`` (it writes a marker file when imported) and an
    ``auto_map`` pointing at it in ``where`` (config.json with a custom architecture, or tokenizer_config.json)."""
    release, marker = shutil.copytree(tiny_llama, root / f"evil-{where}"), root / f"marker-{where}"
    (release / "evil.py").write_text(EVIL_CODE.format(marker=str(marker)), encoding="utf-8")
    if where == "config":
        _edit_json(release / "config.json", architectures=["EvilForCausalLM"], model_type="evil",
                   auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"})
    else:
        _edit_json(release / "tokenizer_config.json", auto_map={"AutoTokenizer": [None, "evil.EvilTokenizer"]})
    return release, marker


@pytest.mark.parametrize("where", ["config", "tokenizer"])
def test_cli_decide_on_a_release_with_custom_code_runs_nothing_and_reads_no_stdin(tiny_llama: Path, tmp_path: Path,
                                                                                   where: str) -> None:
    """Before the fix, transformers printed "Do you wish to run the custom code? [y/N]" on stdout and a "y" on
    stdin ran evil.py. Now: one error line naming the file and the key, exit 2, nothing on stdout, the "y" still
    unread in the pipe, no marker."""
    release, marker = _evil_release(tiny_llama, tmp_path, where)
    read_end, write_end = os.pipe()
    os.write(write_end, b"y\n")
    os.close(write_end)
    try:
        result = subprocess.run([sys.executable, "-m", "clef_local.cli", "decide", "--model", str(release),
                                 "--example", "triage"], stdin=read_end, capture_output=True, text=True, timeout=300,
                                env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf_modules")})
        os.set_blocking(read_end, False)
        left = os.read(read_end, 16)
    finally:
        os.close(read_end)
    file = release / ("config.json" if where == "config" else "tokenizer_config.json")
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {file}: auto_map names Python code"), result.stderr
    assert left == b"y\n"  # stdin was never read
    assert not marker.exists()
    assert not (tmp_path / "hf_modules").exists()  # transformers never copied the module to import it


def test_read_release_refuses_auto_map_anywhere_in_the_configs(tiny_qwen: Path, tmp_path: Path) -> None:
    release = shutil.copytree(tiny_qwen, tmp_path / "r")
    read_release(release)
    config = json.loads((release / "config.json").read_text())
    config["text_config"]["auto_map"] = {"AutoModel": "x.Y"}
    (release / "config.json").write_text(json.dumps(config))
    with pytest.raises(ReleaseError) as info:
        read_release(release)
    assert str(info.value).startswith(f"{release / 'config.json'}: text_config.auto_map names Python code")
    del config["text_config"]["auto_map"]
    (release / "config.json").write_text(json.dumps(config))
    _edit_json(release / "tokenizer_config.json", auto_map={"AutoTokenizer": ["x.T", None]})
    with pytest.raises(ReleaseError, match=r"tokenizer_config.json: auto_map names Python code"):
        clef_local.load(release)


def test_the_backbone_loaders_never_ask_to_run_code(tiny_llama: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Past read_release (a caller that builds the backbone itself): transformers refuses the custom architecture
    instead of asking. ``input`` answers "y" as a user would; it must never be called."""
    import torch
    import transformers

    from clef_local.backends.skeleton import load_variant_backbone
    from clef_local.backends.torch_backend import TorchBackbone

    release, marker = _evil_release(tiny_llama, tmp_path, "config")
    asked: list[str] = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "y")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    config = json.loads((release / "config.json").read_text())
    with pytest.raises(ReleaseError, match="the backbone cannot be loaded") as info:
        TorchBackbone(release, config)
    assert "\n" not in str(info.value)
    with pytest.raises(ReleaseError, match="the backbone config cannot be read"):
        load_variant_backbone(transformers.AutoModelForCausalLM, release, [release / "model.safetensors"], "int8",
                              torch.float32)
    assert asked == [] and not marker.exists()


@pytest.mark.parametrize("name", ["GPT2Tokenizer", "LlamaTokenizer", "BertTokenizer", None])
def test_a_tokenizer_class_outside_the_format_is_refused(tiny_llama: Path, tmp_path: Path, name: str | None) -> None:
    release = shutil.copytree(tiny_llama, tmp_path / "r")
    config = json.loads((release / "tokenizer_config.json").read_text())
    if name is None:
        del config["tokenizer_class"]
    else:
        config["tokenizer_class"] = name
    (release / "tokenizer_config.json").write_text(json.dumps(config))
    found = f"tokenizer_class {name!r}" if name else "no tokenizer_class"
    allowed = ", ".join(TOKENIZER_CLASSES)
    message = f"{release / 'tokenizer_config.json'}: {found}; a Clef release names one of {allowed}"
    for reader in (read_release, ReleaseTokenizer, clef_local.load):
        with pytest.raises(ReleaseError) as info:
            reader(release)
        assert str(info.value) == message


def test_allowed_tokenizer_classes_give_the_same_ids(tiny_llama: Path, tmp_path: Path) -> None:
    """The demo's class (PreTrainedTokenizerFast) and Qwen's both run tokenizer.json as written here."""
    pieces = ["x  1 2024", "hello ที่นี่", "OPTION 3: "]
    expected = ReleaseTokenizer(tiny_llama).encode_pieces(pieces)
    release = shutil.copytree(tiny_llama, tmp_path / "r")
    for name in ("PreTrainedTokenizerFast", "TokenizersBackend", "Qwen3_5Tokenizer"):
        _edit_json(release / "tokenizer_config.json", tokenizer_class=name)
        assert ReleaseTokenizer(release).encode_pieces(pieces) == expected, name


def test_a_built_tokenizer_outside_the_format_is_refused(tiny_llama: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers may substitute a class for the named one: the class it built is checked too."""
    import transformers

    class SomethingElse:
        backend_tokenizer = None

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: SomethingElse())
    with pytest.raises(ReleaseError, match=r"transformers built a SomethingElse from tokenizer_config\.json"):
        ReleaseTokenizer(tiny_llama)
