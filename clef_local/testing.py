"""Tiny random Clef releases for tests and smoke tests (no download, seconds on a CPU): :func:`build_tiny_release`
writes the exact release layout (docs/format.md) with a random Qwen3.5 or Llama backbone and head, and a
``joint_schema_model.py`` canary that raises if anything imports it; the same seed gives the same bytes.
:func:`build_shaped_release` writes any config's full shapes (:mod:`clef_local.synthetic`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Literal

import torch

from clef_local.formats.release import write_json
from clef_local.heads.torch_head import HeadConfig, JointSchemaHead
from clef_local.runtime.hf_bars import hf_progress_bars
from clef_local.synthetic import DEFAULT_SHARD_BYTES, write_shaped_weights

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
)
ADDED_TOKENS = ("<think>", "</think>")  # added, not special (as in Qwen3.5)
DEFAULT_HEAD = HeadConfig(hidden_size=64, width=32, routing_layers=1, layers=2, heads=4, feedforward=64)
_BPE_VOCAB = 504  # byte alphabet (256) + merges; + 9 added tokens = 513 ids
# transformers 5 does not load tokenizer.json as is: it rebuilds the pipeline (NFC normalizer, regex split, byte
# level) from vocab + merges, with Qwen3_5Tokenizer for a `qwen3_5` config whatever tokenizer_config.json says, and
# with Qwen2Tokenizer for the llama release. tokenizer.json must use that class's regex, or AutoTokenizer and
# `tokenizers` disagree (on combining marks: Devanagari, Thai, ...).
_REGEX = {
    "qwen3_5": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "llama": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+""",
}
_CORPUS = """\
<|im_start|>system
Read the complete state and schema. Decide every field jointly. Each answer must be exactly one of that field's
allowed options.<|im_end|>
<|im_start|>user
STATE:
{"account":{"balance":1250.75,"currency":"EUR","status":"active"},"customer":"Ada Lovelace","messages":[
"My card was declined at the store yesterday, and I still do not know why.","Can you help me please?"]}

SCHEMA FIELDS:

FIELD 1
ID: intent
TYPE: choice
INSTRUCTION: What does the customer want? Pick the single best intent for the whole conversation.
ALLOWED OPTIONS:
OPTION 1: {"description":"The card payment was declined.","option_id":"card_declined"}
OPTION 2: {"description":"The customer wants to know the balance of the account.","option_id":"balance"}
OPTION 3: {"option_id":"other"}
END FIELD

FIELD 2
ID: urgent
TYPE: noul
INSTRUCTION: Is the request urgent?
ALLOWED OPTIONS:
OPTION 1: {"description":"The proposition is true or the answer is yes.","option_id":"true"}
OPTION 2: {"description":"The proposition is false or the answer is no.","option_id":"false"}
END FIELD

FIELD 3
ID: sentiment
TYPE: score
INSTRUCTION: {"question":"How satisfied is the customer?","scale":[0,1,2,3,4]}
ALLOWED OPTIONS:
OPTION 1: {"description":"very unhappy","option_id":"0"}
OPTION 2: {"description":"neutral","option_id":"1"}
OPTION 3: {"description":"very happy","option_id":"2"}
END FIELD

<|im_end|>
<|im_start|>assistant
<think>

</think>

JOINT SCHEMA DECISIONS: true false null [] {} "option_id" "description" 0.5 1e-3 -42 100%
The quick brown fox jumps over the lazy dog. Decisions are made jointly, for every question at once, and the
probabilities of the allowed options always sum to one. A model that generates tokens can answer outside the
allowed options; a decision model cannot. It reads the state, the schema and the instructions, then it scores.
{"language":"हिन्दी","text":"मेरा कार्ड अस्वीकार कर दिया गया","thai":"ภาษาไทย บัตรของฉันถูกปฏิเสธ"} café 😀
"""
_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_NOTICE = (
    "This is a TINY RANDOM TEST RELEASE built by clef_local.testing.build_tiny_release.\n"
    "It has the layout of a Clef release, but its weights are random: its decisions mean nothing.\n"
    "It contains no Cloudflare or Qwen weights.\n"
)
_LICENSE = (
    "Licensed under the Apache License, Version 2.0 (the \"License\"); you may not use these files except in\n"
    "compliance with the License. You may obtain a copy of the License at\n\n"
    "    http://www.apache.org/licenses/LICENSE-2.0\n\n"
    "Unless required by applicable law or agreed to in writing, software distributed under the License is\n"
    "distributed on an \"AS IS\" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.\n"
)
_CANARY = (
    '"""Canary of a tiny test release: stands for the reference code that clef-local must never run."""\n\n'
    "raise RuntimeError(\"clef-local must never import a release's joint_schema_model.py\")\n"
)
# The keys of Clef-flash's text config (clef_local/planning/configs/clef-flash.config.json) that the shrinking
# below does not override, written out so the tiny release's bytes never change with that file
# (tests/test_testing.py checks the two agree).
_REAL_TEXT = {
    "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu", "mlp_only_layers": [],
    "model_type": "qwen3_5_text", "mtp_use_dedicated_embeddings": False, "rms_norm_eps": 1e-06,
    "use_cache": True, "mamba_ssm_dtype": "float32",
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                        "rope_theta": 10000000, "partial_rotary_factor": 0.25},
}


def build_tiny_release(
    path: str | Path,
    backbone: Literal["qwen3_5", "llama"] = "qwen3_5",
    seed: int = 0,
    *,
    head_config: HeadConfig | None = None,
    shards: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    vision: bool = False,
) -> Path:
    """Write a tiny random release in the exact Clef layout (docs/format.md) at ``path`` and return that path.

    ``path`` is created; an existing non-empty directory is refused. ``backbone`` picks a tiny
    ``Qwen3_5ForConditionalGeneration`` (text model + vision tower, as Clef) or a tiny ``LlamaForCausalLM`` (as the
    demo model). ``head_config`` defaults to :data:`DEFAULT_HEAD`; its ``hidden_size`` is forced to the backbone's.
    ``shards > 1`` writes ``model-0000N-of-0000M.safetensors`` + ``model.safetensors.index.json``. The backbone is
    saved in ``dtype`` (BF16 like real releases), the head in float32. The same arguments give the same bytes.

    ``vision=True`` (Qwen3.5 only) names the PIL image processor, ``Qwen2VLImageProcessorPil``, in
    ``preprocessor_config.json``, so that images go through a processor the default install has (the torchvision
    one does not import beside the CPU torch wheel); the weights, tokenizer and other files are those of
    ``vision=False``. Videos still need torchvision (the ``video`` extra).
    """
    if backbone not in ("qwen3_5", "llama"):
        raise ValueError(f"backbone must be 'qwen3_5' or 'llama', not {backbone!r}")
    if vision and backbone != "qwen3_5":
        raise ValueError("vision=True needs backbone='qwen3_5' (the llama backbone has no vision tower)")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, not {shards}")
    out = _empty_directory(path, "a tiny release")

    ids = _write_tokenizer(out, backbone)
    vocab_size = -(-(max(ids.values()) + 1) // 8) * 8
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hidden = _write_backbone(out, backbone, ids, vocab_size, shards, dtype, vision)
        torch.manual_seed(seed + 1)
        _write_head(out, dataclasses.replace(head_config or DEFAULT_HEAD, hidden_size=hidden))
    (out / "LICENSE").write_text(_LICENSE, encoding="utf-8")
    (out / "NOTICE").write_text(_NOTICE, encoding="utf-8")
    (out / "joint_schema_model.py").write_text(_CANARY, encoding="utf-8")
    return out


def build_shaped_release(config: str | Path, out: str | Path, *, scheme: str = "bf16", layers: int | None = None,
                         seed: int = 0, vocab_size: int | None = None, head_config: str | Path | None = None,
                         group_size: int = 64, shard_bytes: int = DEFAULT_SHARD_BYTES,
                         workers: int | None = None, hashes: bool = True) -> Path:
    """Write a release with random weights of the exact shapes of the backbone ``config`` (a ``config.json``
    path; ``clef_local.planning.planner.packaged_config("clef")`` is Clef 27B's) at ``out``, return that path.

    The backbone is stored directly as ``scheme`` (``bf16``, ``int4``, ``int8``, ``nf4``, ``fp8``; docs/format.md
    §6), streamed piece by piece (the memory held is a few tens of MiB whatever the model's size), with a random
    head of ``head_config`` (default: the one beside ``config``), the tokenizer and legal files of
    :func:`build_tiny_release` (the special token ids in ``config.json`` are set to that tokenizer's) and a manifest
    with every file's SHA-256 (:mod:`clef_local.synthetic`). ``layers``: only the first ``layers`` decoder layers
    (a reduced copy of the same shapes, for CPU tests); ``vocab_size``: a smaller vocabulary (the embeddings
    dominate a reduced copy). Seeded and deterministic; ``workers`` threads generate the values (default: every
    usable core); ``hashes=False`` leaves the weights' SHA-256 out of the manifest (faster on a fast disk).
    """
    out = _empty_directory(out, "a shaped release")
    ids = _write_tokenizer(out, "qwen3_5")
    _write_processor_configs(out)
    (out / "LICENSE").write_text(_LICENSE, encoding="utf-8")
    (out / "NOTICE").write_text(_NOTICE.replace("TINY RANDOM", "RANDOM").replace("build_tiny_release",
                                                                                  "build_shaped_release"),
                                encoding="utf-8")
    (out / "joint_schema_model.py").write_text(_CANARY, encoding="utf-8")
    return write_shaped_weights(config, out, scheme=scheme, layers=layers, vocab_size=vocab_size, seed=seed,
                                token_ids=ids, head_config=head_config, group_size=group_size,
                                shard_bytes=shard_bytes, workers=workers, hashes=hashes)


def _empty_directory(path: str | Path, what: str) -> Path:
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"refusing to build {what} into {out}: it exists and is not an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


@functools.lru_cache(maxsize=2)
def _tokenizer_json(regex: str) -> str:
    """The trained tokenizer, serialized (trained once per process: building it is the slow part)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(vocab_size=_BPE_VOCAB, min_frequency=1, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # Words with combining marks, frequent enough that merges cross the marks (and the regex matters).
    tok.train_from_iterator([_CORPUS] * 3 + ["ที่นี่ हिन्दी मेरा "] * 16, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok.to_str()


def _write_tokenizer(out: Path, backbone: str) -> dict[str, int]:
    """Write the tokenizer files; return the ids of the added tokens."""
    text = _tokenizer_json(_REGEX[backbone])
    data = json.loads(text)
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    write_json(out / "vocab.json", data["model"]["vocab"])
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    added = {t["id"]: t for t in data["added_tokens"]}
    ids = {t["content"]: i for i, t in added.items()}
    special_rest = [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"]
    write_json(out / "tokenizer_config.json", {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": t["content"], "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": t["special"]} for i, t in sorted(added.items())},
        "additional_special_tokens": special_rest, "bos_token": None, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 262144 if backbone == "qwen3_5" else 8192,
        "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    })
    write_json(out / "special_tokens_map.json", {
        "additional_special_tokens": special_rest, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
    })
    (out / "chat_template.jinja").write_text(_CHAT_TEMPLATE, encoding="utf-8")
    return ids


def _write_backbone(out: Path, backbone: str, ids: dict[str, int], vocab_size: int, shards: int,
                    dtype: torch.dtype, vision: bool = False) -> int:
    """Build, randomly initialise and save the backbone; return its hidden size."""
    from transformers import GenerationConfig

    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    if backbone == "qwen3_5":
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**_qwen_config_dict(ids, vocab_size)))
        bos = None
        _write_processor_configs(out, vision)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        bos = ids["<|im_start|>"]
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-5,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
            bos_token_id=bos, eos_token_id=eos, pad_token_id=pad))
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    model = model.to(dtype).eval()
    with hf_progress_bars(False):  # "Writing model shards" is noise in a test log
        model.save_pretrained(out, safe_serialization=True, max_shard_size=_shard_limit(model, shards))
    if backbone == "llama":  # docs/hardware.md, known traps: older readers ignore rope_parameters; write rope_theta too
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
        config["rope_theta"] = config["rope_parameters"]["rope_theta"]
        write_json(out / "config.json", config)
    _check_shards(out, shards)
    return int(model.config.get_text_config().hidden_size)


def _qwen_config_dict(ids: dict[str, int], vocab_size: int) -> dict[str, Any]:
    """Clef-flash's real config (``clef_local/planning/configs``), shrunk; its keys are kept."""
    text = json.loads(json.dumps(_REAL_TEXT))
    text.update(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, full_attention_interval=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_conv_kernel_dim=4, vocab_size=vocab_size, eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False, max_position_embeddings=262144,
        attn_output_gate=True, mtp_num_hidden_layers=0, initializer_range=0.02,
    )
    # 8 of 16 head dims rotate (4 frequencies), split T/H/W like the real 11/11/10 of 32.
    text["rope_parameters"].update(mrope_section=[2, 1, 1], partial_rotary_factor=0.5)
    vision = dict(model_type="qwen3_5_vision", depth=1, hidden_size=32, out_hidden_size=64, num_heads=2,
                  intermediate_size=64, deepstack_visual_indexes=[], num_position_embeddings=64, patch_size=16,
                  spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3, hidden_act="gelu_pytorch_tanh")
    return {
        "text_config": text, "vision_config": vision, "tie_word_embeddings": False,
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
    }


# Qwen2-VL's image processors: the torchvision one (what real releases name) and the PIL one (no torchvision needed)
IMAGE_PROCESSORS = {False: "Qwen2VLImageProcessorFast", True: "Qwen2VLImageProcessorPil"}


def _write_processor_configs(out: Path, vision: bool = False) -> None:
    """Qwen3-VL-style processor files (a release carries them; the tiny vision tower uses 16-pixel patches), with
    Qwen3.5's pixel bounds (65,536 to 16,777,216 pixels per image)."""
    common = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
              "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
              "do_resize": True, "rescale_factor": 0.00392156862745098, "processor_class": "Qwen3VLProcessor"}
    write_json(out / "processor_config.json", {"processor_class": "Qwen3VLProcessor"})
    write_json(out / "preprocessor_config.json", {**common, "image_processor_type": IMAGE_PROCESSORS[vision],
                                             "size": {"longest_edge": 16777216, "shortest_edge": 65536}})
    write_json(out / "video_preprocessor_config.json", {
        **common, "video_processor_type": "Qwen3VLVideoProcessor", "fps": 2, "min_frames": 4, "max_frames": 768,
        "do_sample_frames": True, "size": {"longest_edge": 25165824, "shortest_edge": 4096}})


def _shard_limit(model: torch.nn.Module, shards: int) -> int | str:
    """``max_shard_size`` for ``save_pretrained``: one file, or ``shards`` files of about equal size."""
    if shards == 1:
        return "100GB"
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    return total // shards + 1


def _check_shards(out: Path, shards: int) -> None:
    """Make the weights exactly ``shards`` files: when ``save_pretrained`` missed the count (its greedy packing
    may open one more shard), re-split its tensors into ``shards`` runs of consecutive names."""
    from safetensors.torch import load_file, save_file

    files = sorted(out.glob("model*.safetensors"))
    if len(files) == shards:
        return
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
        file.unlink()
    names = sorted(tensors)
    if len(names) < shards:
        raise ValueError(f"cannot split {len(names)} tensors into {shards} shards")
    weight_map: dict[str, str] = {}
    for shard in range(shards):
        run = names[shard * len(names) // shards:(shard + 1) * len(names) // shards]
        file_name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in run}, out / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(run, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    params = sum(t.numel() for t in tensors.values())
    write_json(out / "model.safetensors.index.json",
          {"metadata": {"total_parameters": params, "total_size": total}, "weight_map": weight_map})


def _write_head(out: Path, config: HeadConfig) -> None:
    """A random head in which every parameter matters (non-zero gates and scales, non-trivial norms and biases)."""
    from safetensors.torch import save_file

    head = JointSchemaHead(config)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name in ("prior_logit_scale", "joint_logit_scale"):
                param.uniform_(0.5, 2.0)
            elif name == "residual_gate":
                param.copy_(torch.empty(()).uniform_(0.3, 1.0) * (1 if torch.rand(()) < 0.5 else -1))
            elif "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in head.state_dict().items()}
    save_file(state, out / "joint_head.safetensors", metadata={"format": "pt"})
    keys = ("hidden_size", "width", "routing_layers", "layers", "heads", "feedforward")
    write_json(out / "joint_head_config.json", {k: getattr(config, k) for k in keys})


# Cloudflare's reference, shipped unmodified in the PyPI package clef-finetune (docs/format.md).
REFERENCE_SHA256 = "0e304cf7c6500e8bb59bef7e2afd2c6373f82596dfb3b57d1aa93c175e2dc3a3"


def load_reference_oracle() -> Any:
    """Cloudflare's ``joint_schema_model.py`` from the ``clef-finetune`` package, imported by path, as a test
    oracle for parity tests and benchmarks (``pip install --no-deps clef-finetune``). Never used at run time."""
    import hashlib
    import importlib.util
    import sys

    spec = importlib.util.find_spec("clef_finetune")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the reference oracle needs: pip install --no-deps clef-finetune")
    path = Path(next(iter(spec.submodule_search_locations))) / "_vendor" / "joint_schema_model.py"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != REFERENCE_SHA256:
        raise ValueError(f"{path} is not the unmodified reference (SHA-256 {digest})")
    name = "clef_reference_oracle"
    if name not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ModuleNotFoundError(f"{path}: cannot be imported as a module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    return sys.modules[name]


class ListedOrderFault:
    """A backend with a seeded fault, for testing robustness checks (``clef-local probe``'s ``option_order``): it
    hands each choice question's option logits out in the order the *request lists* the options instead of the
    model's sorted order, so the answer depends on how the options happen to be listed. Everything else is the
    wrapped backend's: ``model.backend = ListedOrderFault(model.backend)``."""

    def __init__(self, backend: Any) -> None:
        self.inner = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def logits(self, records: Any, layout: Any, pad_token_id: int, cache: Any = None) -> Any:
        import numpy as np

        logits = np.asarray(self.inner.logits(records, layout, pad_token_id, cache))
        out = logits.copy()
        row = 0
        for record in records:
            for question in record.questions:
                asked = record.request.questions[question.question_id]
                if asked.type == "choice" and isinstance(asked.criteria, dict):
                    listed = [str(option) for option in asked.criteria]
                    # the logit of the i-th option in model order is reported for the i-th option as listed
                    out[row, [list(question.option_ids).index(o) for o in listed]] = logits[row, :len(listed)]
                row += 1
        return out
