"""The tokenizer metadata of a GGUF (``tokenizer.ggml.*``), from the release's ``tokenizer.json``, as llama.cpp's
``convert_hf_to_gguf.py`` writes it for a GPT-2-style BPE vocabulary (``TextModel._set_vocab_gpt2``).

clef-local tokenizes with the release's own tokenizer and feeds llama.cpp token ids, so the vocabulary only has to
load and keep every id where it is; llama.cpp's own tokenizer (a user running the GGUF in llama-cli) also needs the
right pre-tokenizer name (``tokenizer.ggml.pre``), read here from the pre-tokenizer that ``tokenizer.json`` declares.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_local.errors import ReleaseError

log = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType; llama.h llama_token_type): written as int32
NORMAL, UNUSED, CONTROL, USER_DEFINED = 1, 5, 3, 4
# The split regexes of the tokenizers llama.cpp implements by name (src/llama-vocab.cpp, "original regex from
# tokenizer.json"), and the Digits + ByteLevel pipeline of SmolLM2 (the demo backbone's, llama.cpp's "smollm").
_QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN35_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+"""
                 r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPLIT_PRE = {_QWEN2_REGEX: "qwen2", _QWEN35_REGEX: "qwen35"}
DEFAULT_PRE = "default"


@dataclass(frozen=True)
class Vocab:
    """What :func:`write_vocab` writes: one token per id up to ``vocab_size``, its type, the pre-tokenizer name."""

    tokens: list[str]
    types: list[int]
    pre: str


def _looks_special(token: str) -> bool:
    """llama.cpp's ``does_token_look_special`` for the forms a Clef tokenizer has (``<|im_start|>``)."""
    return token.startswith("<|") and token.endswith("|>")


def pre_tokenizer_name(pre: Any) -> str:
    """llama.cpp's name for the ``pre_tokenizer`` of a ``tokenizer.json``: ``qwen35`` (Clef, Clef-flash), ``qwen2``,
    ``smollm`` (the demo model); :data:`DEFAULT_PRE` (logged) for any other, which loads and keeps every id but
    splits text differently in llama.cpp's own tokenizer (clef-local never uses it)."""
    steps = pre.get("pretokenizers", []) if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") if isinstance(s, dict) else None for s in steps]
    if kinds == ["Split", "ByteLevel"]:
        pattern = steps[0].get("pattern") or {}
        name = SPLIT_PRE.get(pattern.get("Regex", ""))
        if name and not steps[1].get("use_regex", True):
            return name
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    log.warning("the tokenizer's pre-tokenizer is not one llama.cpp names: the GGUF says %r (clef-local feeds "
                "token ids and is not affected; llama.cpp's own tokenizer would split text differently)", DEFAULT_PRE)
    return DEFAULT_PRE


def read_vocab(release_dir: Path, vocab_size: int) -> Vocab:
    """The token list of ``release_dir/tokenizer.json`` padded to ``vocab_size`` (``[PAD{i}]``, unused), with
    llama.cpp's token types: added special or ``<|…|>`` tokens are control, other added tokens user-defined."""
    path = release_dir / "tokenizer.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReleaseError(f"{path}: cannot be read ({exc}); a release to export as GGUF needs its "
                           f"tokenizer.json") from exc
    model = data.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ReleaseError(f"{path}: a {model.get('type')!r} tokenizer; clef-local writes GGUF for BPE tokenizers "
                           f"(Clef's and the demo model's)")
    by_id: dict[int, str] = {int(i): tok for tok, i in model["vocab"].items()}
    added = {int(t["id"]): t for t in data.get("added_tokens") or []}
    for i, token in added.items():
        by_id[i] = token["content"]
    if by_id and max(by_id) >= vocab_size:
        raise ReleaseError(f"{path}: token id {max(by_id)} is outside the model's vocab_size {vocab_size} in "
                           f"config.json; the tokenizer and the backbone do not belong together")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        token = by_id[i]
        tokens.append(token)
        if i in added:
            types.append(CONTROL if added[i].get("special") or _looks_special(token) else USER_DEFINED)
        else:
            types.append(NORMAL)
    return Vocab(tokens, types, pre_tokenizer_name(data.get("pre_tokenizer")))


def write_vocab(writer: Any, release_dir: Path, vocab_size: int, *, space_prefix: bool = False) -> Vocab:
    """Add ``tokenizer.ggml.*`` to a ``gguf.GGUFWriter``: model ``gpt2``, the pre-tokenizer, tokens, types, and
    (through gguf-py's ``SpecialVocab``, as llama.cpp's converter does) the merges, the special token ids, the
    add-BOS/EOS flags and the chat template; ``space_prefix`` adds ``tokenizer_config.json``'s ``add_prefix_space``
    (llama.cpp's ``LlamaModel`` does)."""
    import gguf

    vocab = read_vocab(release_dir, vocab_size)
    config_path = release_dir / "tokenizer_config.json"
    if space_prefix and config_path.is_file():
        from clef_local.formats.release import read_json

        if (value := read_json(config_path).get("add_prefix_space")) is not None:
            writer.add_add_space_prefix(bool(value))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    gguf.SpecialVocab(release_dir, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)
    return vocab
