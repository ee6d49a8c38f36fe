"""Reading a Clef release directory (docs/format.md §1): configs, weight files, and the joint schema head, strictly.

A release never runs code: its ``joint_schema_model.py`` is never imported, a config naming code to import
(``auto_map``) is refused at read time, and so is a ``tokenizer_class`` outside :data:`TOKENIZER_CLASSES`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from clef_local.errors import ReleaseError
from clef_local.formats.head_config import HeadConfig

log = logging.getLogger(__name__)

CONFIG = "config.json"
HEAD_CONFIG = "joint_head_config.json"
HEAD_WEIGHTS = "joint_head.safetensors"
SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# A GGUF release's backbone (clef_local.formats.gguf_release holds the rest of that layout; it reads this module, so
# the one path this reader needs lives here)
GGUF_WEIGHTS = "gguf/model.gguf"
TOKENIZER_CONFIG = "tokenizer_config.json"
QWEN3_5 = "Qwen3_5ForConditionalGeneration"
# The tokenizer classes a release may name (docs/format.md §1): Qwen's (Clef, Clef-flash, the tiny test releases)
# and the plain tokenizers-backed class (the demo backbone: its tokenizer.json pipeline runs as written). Any other
# class makes transformers rebuild or replace the pipeline, which changes the token ids and so the answers.
TOKENIZER_CLASSES = ("Qwen2Tokenizer", "Qwen2TokenizerFast", "Qwen3_5Tokenizer", "Qwen3_5TokenizerFast",
                     "PreTrainedTokenizerFast", "TokenizersBackend")
# Config keys with which a directory tells transformers to import its own Python files.
REMOTE_CODE_KEYS = ("auto_map",)


def write_json(path: Path, value: Any) -> None:
    """``value`` as indented UTF-8 JSON (the layout of a release's own JSON files), ending in a newline."""
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; a missing or malformed file is a :class:`ReleaseError` naming it."""
    if not path.is_file():
        raise ReleaseError(f"{path} is missing")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReleaseError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ReleaseError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def _remote_code_keys(value: Any, where: str = "") -> list[str]:
    """The dotted paths of every :data:`REMOTE_CODE_KEYS` key in a JSON value (nested configs included)."""
    found: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            if key in REMOTE_CODE_KEYS:
                found.append(path)
            found += _remote_code_keys(item, path)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _remote_code_keys(item, f"{where}[{i}]")
    return found


def check_no_remote_code(path: Path, config: dict[str, Any]) -> None:
    """Refuse a config (``config.json``, ``tokenizer_config.json``) that names code to import: ``auto_map``."""
    if keys := _remote_code_keys(config):
        raise ReleaseError(f"{path}: {', '.join(keys)} names Python code to run with the model; clef-local never "
                           f"runs a release's code: remove the key (a Clef release needs no custom code)")


def check_tokenizer_config(path: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` at ``path``: no ``auto_map``, and a ``tokenizer_class`` from
    :data:`TOKENIZER_CLASSES` (any other class, or none, lets transformers choose the pipeline)."""
    config = read_json(path)
    check_no_remote_code(path, config)
    name = config.get("tokenizer_class")
    if name not in TOKENIZER_CLASSES:
        found = f"tokenizer_class {name!r}" if name is not None else "no tokenizer_class"
        raise ReleaseError(f"{path}: {found}; a Clef release names one of {', '.join(TOKENIZER_CLASSES)}")
    return config


def read_head_config(path: Path) -> HeadConfig:
    """``joint_head_config.json``: the six required keys, optional ``dropout``, nothing else."""
    raw = read_json(path)
    allowed = set(HeadConfig.keys())
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ReleaseError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(HeadConfig.keys())}")
    missing = sorted(allowed - {"dropout"} - set(raw))
    if missing:
        raise ReleaseError(f"{path}: missing key(s) {', '.join(missing)}")
    for key, value in raw.items():
        ok = isinstance(value, float | int) if key == "dropout" else isinstance(value, int) and value > 0
        if not ok or isinstance(value, bool):
            raise ReleaseError(f"{path}: {key} must be a positive integer (dropout a number), got {value!r}")
    return HeadConfig(**raw)


def head_config_beside(config_path: Path) -> Path | None:
    """The joint head config that goes with a bare backbone ``config_path``: ``NAME.joint_head_config.json`` beside
    ``NAME.config.json`` (the packaged shapes), else ``joint_head_config.json`` beside it, else None."""
    stem = config_path.name.removesuffix(".json").removesuffix(".config").removesuffix("config")
    for candidate in (config_path.with_name(f"{stem}.joint_head_config.json" if stem else HEAD_CONFIG),
                      config_path.with_name(HEAD_CONFIG)):
        if candidate.is_file():
            return candidate
    return None


@dataclass(frozen=True)
class Release:
    """A release directory, read but not loaded: configs and the list of weight files.

    ``gguf`` is the directory's ``gguf/model.gguf`` when it has one (:mod:`clef_local.formats.gguf_release`); a GGUF
    release has no safetensors backbone, and its ``weight_files`` is that one file."""

    path: Path
    config: dict[str, Any]
    head_config: HeadConfig
    weight_files: tuple[Path, ...]
    gguf: Path | None = None

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or ["unknown"]
        return str(archs[0])

    @property
    def is_qwen3_5(self) -> bool:
        return self.architecture == QWEN3_5 or self.config.get("model_type") == "qwen3_5"

    @property
    def text_config(self) -> dict[str, Any]:
        """The text model's config (``text_config`` of a multimodal backbone, else the config itself)."""
        return self.config.get("text_config") or self.config

    @property
    def hidden_size(self) -> int:
        return int(self.text_config["hidden_size"])

    @property
    def max_position_embeddings(self) -> int | None:
        value = self.text_config.get("max_position_embeddings")
        return int(value) if value else None

    @property
    def dtype(self) -> str:
        """The stored dtype name (``bfloat16`` for real releases)."""
        return str(self.text_config.get("dtype") or self.config.get("torch_dtype") or self.config.get("dtype")
                   or "float32")

    @property
    def is_gguf(self) -> bool:
        """True for a GGUF release: its backbone is ``gguf/model.gguf`` only (no safetensors to load with torch)."""
        return self.gguf is not None and self.weight_files == (self.gguf,)

    @property
    def has_vision(self) -> bool:
        return "vision_config" in self.config

    @property
    def quantization(self) -> dict[str, Any] | None:
        return self.config.get("quantization_config")

    def __fspath__(self) -> str:
        """Its directory: a release read once travels where a path is expected (``Path(release)``) and is not read
        again where a :class:`Release` is accepted."""
        return str(self.path)

    @cached_property
    def weight_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.weight_files)


def find_weight_files(path: Path) -> tuple[Path, ...]:
    """The backbone weight files of the directory ``path``: the shards named by ``model.safetensors.index.json``
    (sorted, each present), else ``model.safetensors``; neither is a :class:`ReleaseError`."""
    index = path / WEIGHTS_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ReleaseError(f"{index}: has no weight_map")
        files = tuple(path / name for name in sorted(set(weight_map.values())))
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ReleaseError(f"{path}: shard(s) named in {WEIGHTS_INDEX} are missing: {', '.join(missing)}")
        return files
    if (path / SINGLE_WEIGHTS).is_file():
        return (path / SINGLE_WEIGHTS,)
    raise ReleaseError(f"{path}: no backbone weights ({SINGLE_WEIGHTS} or {WEIGHTS_INDEX} with its shards, or "
                       f"gguf/model.gguf)")


def _check_manifest(path: Path) -> None:
    """When ``path`` has a ``clef_local_manifest.json``: every listed file's size and safetensors header (cheap)."""
    from clef_local.formats.manifest import check_files, read_manifest

    manifest = read_manifest(path)
    if manifest is None:
        return
    problems = check_files(path, manifest)
    if problems:
        raise ReleaseError("files do not match clef_local_manifest.json (run `clef-local verify` for hashes): "
                           + "; ".join(problems))


def read_release(path: str | Path) -> Release:
    """Read and check a release directory's configs and file list; loads no tensor."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ReleaseError(f"{path} is not a directory; pass a Clef release directory (config.json, "
                           f"{HEAD_WEIGHTS}, tokenizer.json, ...)")
    _check_manifest(path)
    config = read_json(path / CONFIG)
    check_no_remote_code(path / CONFIG, config)
    if (path / TOKENIZER_CONFIG).is_file():  # ReleaseTokenizer requires it; plan/quantize read releases without it
        check_tokenizer_config(path / TOKENIZER_CONFIG)
    head_config = read_head_config(path / HEAD_CONFIG)
    if not (path / HEAD_WEIGHTS).is_file():
        raise ReleaseError(f"{path / HEAD_WEIGHTS} is missing")
    gguf = path / GGUF_WEIGHTS if (path / GGUF_WEIGHTS).is_file() else None
    safetensors = (path / WEIGHTS_INDEX).is_file() or (path / SINGLE_WEIGHTS).is_file()
    weight_files = find_weight_files(path) if safetensors or gguf is None else (gguf,)
    release = Release(path=path, config=config, head_config=head_config, weight_files=weight_files, gguf=gguf)
    if head_config.hidden_size != release.hidden_size:
        raise ReleaseError(
            f"{path / HEAD_CONFIG}: hidden_size {head_config.hidden_size} does not match the backbone's "
            f"hidden_size {release.hidden_size} in {CONFIG}"
        )
    return release


def check_head_tensors(file: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Check a head file's header against the file, then compare its tensor names and shapes with ``expected``;
    name every difference."""
    from clef_local.formats.safetensors import read_header

    found = {name: info.shape for name, info in read_header(file).tensors.items()}  # checked against the file
    problems = []
    if missing := sorted(set(expected) - set(found)):
        problems.append("missing tensors: " + ", ".join(missing))
    if unexpected := sorted(set(found) - set(expected)):
        problems.append("unexpected tensors: " + ", ".join(unexpected))
    shapes = [f"{n} {list(found[n])} (expected {list(expected[n])})"
              for n in sorted(set(found) & set(expected)) if found[n] != expected[n]]
    if shapes:
        problems.append("mis-shaped tensors: " + ", ".join(shapes))
    if problems:
        raise ReleaseError(f"{file} does not match {HEAD_CONFIG}: " + "; ".join(problems))
