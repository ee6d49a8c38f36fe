"""The GGUF release layout (``clef-local export-gguf``, issue 48) and the check a GGUF passes before llama.cpp reads it.

A GGUF release is a Clef release without its safetensors backbone (a desk user wants the 5 GB GGUF, not 18 GB of
BF16 beside it)::

    config.json, tokenizer*.json, vocab.json, merges.txt, chat_template.jinja, processor configs, LICENSE, NOTICE
    joint_head.safetensors + joint_head_config.json      byte for byte from the source release
    gguf/model.gguf                                      the text backbone (llama.cpp's ``llama`` / ``qwen35``)
    gguf/vision.safetensors                              a vision tower's tensors byte for byte (Qwen3.5), for torch
    gguf/gguf_config.json                                what wrote it (:func:`read_gguf_config`)
    clef_local_manifest.json                             every file above with its size and SHA-256

:func:`clef_local.formats.release.read_release` opens it (``Release.gguf`` is the GGUF; its ``weight_files`` is that
one file). A GGUF written by llama.cpp's own ``convert_hf_to_gguf.py`` may be placed at ``gguf/model.gguf`` beside a
release's small files: it has no ``gguf_config.json`` and, without a manifest, only the structural checks run.

llama.cpp's C++ parser meets a malformed file with a crash or an unhelpful message, so :func:`check_gguf` reads the
file first in pure Python over a memory map (:mod:`clef_local.formats.gguf_tensors`, the one GGUF header reader:
gguf-py's layout and type sizes without gguf-py's ``GGUFReader``, which takes seconds on a large vocabulary; no
tensor data is read).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from clef_local.errors import ReleaseError
from clef_local.formats.gguf_tensors import GgufTable, gguf_table
from clef_local.formats.release import GGUF_WEIGHTS, QWEN3_5, Release, read_json

log = logging.getLogger(__name__)

GGUF_PATH = GGUF_WEIGHTS  # gguf/model.gguf, relative to the release directory, as the manifest names it
GGUF_DIR, GGUF_FILE = GGUF_PATH.split("/")  # read_release finds the file by the same constant
GGUF_CONFIG = "gguf_config.json"
GGUF_CONFIG_PATH = f"{GGUF_DIR}/{GGUF_CONFIG}"
# The vision tower stays on torch beside the GGUF text model (llama.cpp's multimodal projector is not matched to the
# reference): its tensors, with the source's names, dtypes and bytes, in one safetensors file.
VISION_FILE = "vision.safetensors"
VISION_PATH = f"{GGUF_DIR}/{VISION_FILE}"
GGUF_CONFIG_FORMAT = 1

# The release backbone (:func:`backbone_of`) -> the ``general.architecture`` llama.cpp knows it as. The converter
# registry (clef_local.export.gguf.convert) has one entry per key.
ARCHITECTURES: dict[str, str] = {"llama": "llama", "qwen3_5": "qwen35"}

# Keys of gguf_config.json (written by clef_local.export.gguf.export): the export's --type and llama.cpp's file type,
# the tensor types the file really holds (read back from it: {type: count}), which tensor holds the rows the joint
# head reads (output.weight, or token_embd.weight when tied) and its type, whether an importance matrix was used,
# the tokenizer's pre name, what wrote it (clef_local, gguf, llama_cpp_python versions), the source release
# ({"path", "digest"}: clef_local.formats.manifest.files_digest of its files) and the validation result.
CONFIG_KEYS = ("format", "type", "file_type", "architecture", "tensor_types", "tensor_count", "lm_head_tensor",
               "output_tensor_type", "output_kept_at_source_precision", "imatrix", "pre_tokenizer", "vision",
               "writer", "source", "validation")


def gguf_path(directory: str | Path) -> Path:
    """Where a GGUF release keeps its backbone: ``DIR/gguf/model.gguf`` (it may not exist)."""
    return Path(directory) / GGUF_DIR / GGUF_FILE


def find_gguf(directory: str | Path) -> Path | None:
    """``DIR/gguf/model.gguf`` when it is a file, else None."""
    path = gguf_path(directory)
    return path if path.is_file() else None


def is_backbone_weight(name: str) -> bool:
    """True for a release file that a GGUF release leaves out: the safetensors backbone (``model.safetensors``,
    ``model-0000N-of-0000M.safetensors``, ``model.safetensors.index.json``). The head's file is kept."""
    base = name.rsplit("/", 1)[-1]
    return "/" not in name and base.startswith("model") and (base.endswith(".safetensors")
                                                            or base == "model.safetensors.index.json")


def backbone_of(config: dict[str, Any]) -> str:
    """The backbone key of a release ``config.json`` (a key of :data:`ARCHITECTURES`): ``qwen3_5`` for Clef,
    Clef-flash and the tiny Qwen3.5 releases, ``llama`` for the demo model and the tiny llama releases."""
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    if QWEN3_5 in archs or model_type == "qwen3_5":
        return "qwen3_5"
    if "LlamaForCausalLM" in archs or model_type == "llama":
        return "llama"
    raise ReleaseError(f"config.json: architecture {archs[0] if archs else model_type!r} has no GGUF converter; "
                       f"clef-local writes and reads GGUF for {', '.join(ARCHITECTURES)} backbones")


def read_gguf_config(directory: str | Path) -> dict[str, Any] | None:
    """``gguf/gguf_config.json`` of a GGUF release (what wrote the GGUF: ``type``, ``tensor_types``, ``writer``,
    ``source``; :data:`CONFIG_KEYS`), or None when the directory has none (a GGUF from llama.cpp's converter)."""
    path = Path(directory) / GGUF_DIR / GGUF_CONFIG
    if not path.is_file():
        return None
    config = read_json(path)
    if config.get("format") != GGUF_CONFIG_FORMAT or not isinstance(config.get("tensor_types"), dict):
        raise ReleaseError(f"{path}: not a clef-local gguf_config.json (format {GGUF_CONFIG_FORMAT} with "
                           f"tensor_types); re-export with clef-local export-gguf")
    return config


def source_hint(release: Release) -> str:
    """The release a GGUF release was exported from, for a message: ``the source release (PATH)`` with the path its
    ``gguf_config.json`` records, else ``the source release (safetensors)``."""
    try:
        config = read_gguf_config(release.path)
    except ReleaseError:  # a damaged config is named where it is read; here it only loses the path from a hint
        config = None
    path = ((config or {}).get("source") or {}).get("path")
    return f"the source release ({path})" if path else "the source release (safetensors)"


def require_safetensors(release: Release, command: str) -> None:
    """Refuse a GGUF release for ``command``, which reads the safetensors backbone (quantize, export-onnx): one
    :class:`ReleaseError` naming the source release and ``--backend llamacpp``."""
    if release.is_gguf:
        raise ReleaseError(f"{release.path} is a GGUF release (gguf/model.gguf, no safetensors backbone), which "
                           f"{command} cannot read; give it {source_hint(release)}, or run this release with "
                           f"--backend llamacpp")


def _check_listed(path: Path, directory: Path, *, hashed: bool) -> None:
    """The GGUF against the release manifest: listed, the recorded size, and (``hashed``) the recorded SHA-256."""
    from clef_local.formats.manifest import MANIFEST, read_manifest, sha256

    manifest = read_manifest(directory)
    if manifest is None:
        log.info("%s has no %s: %s is checked for structure only", directory, MANIFEST, path.name)
        return
    name = path.relative_to(directory).as_posix()
    entry = manifest["files"].get(name)
    if entry is None:
        raise ReleaseError(f"{path}: not listed in {directory / MANIFEST}; re-export with clef-local export-gguf, or "
                           f"remove the manifest to load a GGUF from another tool")
    size = path.stat().st_size
    if size != entry["size"]:
        raise ReleaseError(f"{path}: {size} bytes, {MANIFEST} records {entry['size']} (truncated or replaced); "
                           f"copy or re-export the file")
    if hashed and "sha256" in entry and sha256(path) != entry["sha256"]:
        raise ReleaseError(f"{path}: SHA-256 differs from {MANIFEST}; copy or re-export the file")


def check_gguf(path: str | Path, release: Release, *, hashed: bool = False) -> dict[str, Any]:
    """Check a GGUF against its release before llama.cpp reads it; return ``{"architecture", "tensors", "bytes"}``.

    On every load (cheap: the header, the metadata and the tensor table, read over a memory map by
    :func:`clef_local.formats.gguf_tensors.gguf_table`, arrays stepped over, once while the file is unchanged):
    the file is listed in the release manifest with its recorded size (when the directory has a manifest), the
    GGUF magic and version, ``general.architecture`` is the one the release's backbone maps to
    (:data:`ARCHITECTURES`), ``<arch>.embedding_length`` is the backbone's ``hidden_size`` and the head's, and every
    tensor's data lies within the file (a truncated file). With ``hashed`` (at export, and ``clef-local verify``)
    also the SHA-256 the manifest records: minutes for a large file, so not on every load.

    Each failure is one :class:`ReleaseError` naming the file and the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise ReleaseError(f"{path} is missing; export it with clef-local export-gguf")
    if release.path in path.parents:
        _check_listed(path, release.path, hashed=hashed)
    found = gguf_table(path)  # magic, version, a header cut short: each refused in one line
    arch = found.field("general.architecture")
    expected = ARCHITECTURES[backbone_of(release.config)]
    if arch != expected:
        raise ReleaseError(f"{path}: general.architecture is {arch!r}, but the release at {release.path} has a "
                           f"{backbone_of(release.config)} backbone ({expected!r}); use the GGUF exported from this "
                           f"release")
    width = found.field(f"{arch}.embedding_length")
    if width != release.hidden_size:
        raise ReleaseError(f"{path}: {arch}.embedding_length is {width}, the release's config.json has hidden_size "
                           f"{release.hidden_size}; use the GGUF exported from this release")
    if release.head_config.hidden_size != width:
        raise ReleaseError(f"{release.path / 'joint_head_config.json'}: the head reads hidden_size "
                           f"{release.head_config.hidden_size}, {path.name} computes {width}; use the head of the "
                           f"release the GGUF was exported from")
    found.check_extent()
    return {"architecture": arch, "tensors": len(found.tensors), "bytes": found.size}


_checked: set[tuple[str, int, int, str]] = set()


def checked_table(path: str | Path, release: Release) -> GgufTable:
    """:func:`check_gguf` of ``path`` against ``release`` (once while the file is unchanged: the planner and the
    backend both read it on a load), then its :class:`~clef_local.formats.gguf_tensors.GgufTable`."""
    path = Path(path).resolve()
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns, str(Path(release.path).resolve()))
    if key not in _checked:
        check_gguf(path, release)
        _checked.add(key)
    return gguf_table(path)
