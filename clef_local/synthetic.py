"""Full-size random Clef releases in any stored format, written streaming, behind
:func:`clef_local.testing.build_shaped_release`: random weights of the exact public shapes exercise every byte of
memory, every kernel and the loader's arithmetic. :func:`write_shaped_weights` writes shards, config, head and
manifest; how values are drawn, why the stream is bounded and why the bytes are deterministic:
docs/hardware.md#full-size-checks-without-the-weights.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clef_local.formats.head_config import HeadConfig
from clef_local.formats.manifest import list_files, sha256, write_manifest
from clef_local.formats.release import head_config_beside, read_head_config, read_json, write_json
from clef_local.quant import registry
from clef_local.units import GiB

log = logging.getLogger(__name__)

SCHEMES = ("bf16", *registry.SCHEMES)
DEFAULT_SHARD_BYTES = 4 * GiB
PIECE_BYTES = 8 << 20  # bytes of one generated piece (a thread's unit of work)
_TABLE_SEED = 0x5EED  # the fixed normal table (a constant of the format of these files, not of a release)
_NP_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "U32": np.uint32, "I8": np.int8,
              "U8": np.uint8, "F8_E4M3": np.uint8}
_INT_RANGES = {"U32": (0, (1 << 32) - 1), "I8": (-128, 127), "U8": (0, 255)}
_FLOAT_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
Fill = Callable[[np.random.Generator, int, int], np.ndarray]  # (rng, first element, count) -> stored values


@dataclass(frozen=True)
class Stored:
    """One tensor of a file: name, safetensors dtype, shape, and how its values are made (``seed_name``: the name
    whose random streams it uses, so that int4's biases follow their scales piece by piece)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    fill: Fill
    seed_name: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * np.dtype(_NP_DTYPES[self.dtype]).itemsize


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values → bfloat16 bit patterns (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _float_bits(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return to_bf16_bits(values)
    return values.astype(_NP_DTYPES[dtype])


_TABLES: dict[tuple[float, str], np.ndarray] = {}  # filled in the main thread, when a fill is made


def _normal_table(std: float, dtype: str) -> np.ndarray:
    """65,536 N(0, std) values in ``dtype`` (bit patterns for BF16): sampling by index is cheaper than sampling."""
    key = (std, dtype)
    if key not in _TABLES:
        values = np.random.default_rng(_TABLE_SEED).standard_normal(1 << 16).astype(np.float32) * np.float32(std)
        _TABLES[key] = _float_bits(values, dtype)
    return _TABLES[key]


def normal_fill(std: float, dtype: str) -> Fill:
    table = _normal_table(std, dtype)
    return lambda rng, start, count: table[rng.integers(0, 1 << 16, count, dtype=np.uint16)]


def uniform_fill(low: float, high: float, dtype: str, *, random_sign: bool = False) -> Fill:
    def fill(rng: np.random.Generator, start: int, count: int) -> np.ndarray:
        values = rng.uniform(low, high, count).astype(np.float32)
        if random_sign:
            values *= np.where(rng.integers(0, 2, count, dtype=np.uint8) == 1, 1, -1).astype(np.float32)
        return _float_bits(values, dtype)
    return fill


def bytes_fill(dtype: str, transform: Callable[[np.ndarray], np.ndarray] | None = None) -> Fill:
    """Uniform random bit patterns of ``dtype`` (optionally transformed: int8 never uses -128, fp8 never NaN)."""
    np_dtype = _NP_DTYPES[dtype]
    low, high = _INT_RANGES[dtype]

    def fill(rng: np.random.Generator, start: int, count: int) -> np.ndarray:
        raw = rng.integers(low, high, count, dtype=np_dtype, endpoint=True)
        return raw if transform is None else transform(raw)
    return fill


def const_fill(values: np.ndarray) -> Fill:
    flat = np.ascontiguousarray(values).reshape(-1)
    return lambda rng, start, count: flat[start:start + count]


def _fp8_low(codes: np.ndarray) -> np.ndarray:
    return codes & np.uint8(0xBF)  # e4m3fn bytes with the exponent's top bit cleared: |v| <= 1.875, never NaN


def _fp8_rms() -> float:
    import torch

    return float(torch.from_numpy(_fp8_low(np.arange(256, dtype=np.uint8))).view(torch.float8_e4m3fn).float()
                 .square().mean().sqrt())


def _nf4_rms() -> float:
    from clef_local.quant.nf4 import NF4_CODE

    return float(np.sqrt(np.mean(np.square(NF4_CODE))))


INT4_CODE_RMS = math.sqrt((16 * 16 - 1) / 12)  # RMS of q - 8 for q uniform on 0..15 (mean -1/2, zeroed by the sign)
INT8_CODE_RMS = math.sqrt(127 * 128 / 3)  # RMS of q uniform on -127..127


def quantized_tensors(scheme: str, name: str, out_f: int, in_f: int, std: float, group_size: int,
                      source_dtype: str = "BF16") -> list[Stored]:
    """The stored tensors of one ``[out_f, in_f]`` linear weight ``name`` in ``scheme`` (docs/format.md §6), with
    values whose dequantized standard deviation is about ``std`` and whose mean is zero: the fake the scheme's row
    names (:attr:`clef_local.quant.registry.Scheme.fake`)."""
    from clef_local.quant import registry

    if scheme not in registry.SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    fake: Callable[..., list[Stored]] = globals()[registry.get(scheme).fake]
    return fake(name.removesuffix(".weight"), out_f, in_f, std, group_size, source_dtype)


SPREAD = (0.75, 1.25)  # scales vary per group / row / block by up to ±25 %


def int4_tensors(prefix: str, out_f: int, in_f: int, std: float, group_size: int, source_dtype: str) -> list[Stored]:
    """int4 (MLX layout): random codes, a random scale per group and ``bias = -8 · scale`` (codes centred)."""
    low, high = std / INT4_CODE_RMS * SPREAD[0], std / INT4_CODE_RMS * SPREAD[1]
    scales = Stored(f"{prefix}.scales", source_dtype, (out_f, in_f // group_size),
                    uniform_fill(low, high, source_dtype, random_sign=True))

    def biases(rng: np.random.Generator, start: int, count: int) -> np.ndarray:  # -8 · scale, exact in bf16
        bits = scales.fill(rng, start, count)
        values = (bits.astype(np.uint32) << 16).view(np.float32) if source_dtype == "BF16" else bits
        return _float_bits(np.asarray(values, dtype=np.float32) * np.float32(-8), source_dtype)

    return [Stored(f"{prefix}.weight", "U32", (out_f, in_f // 8), bytes_fill("U32")), scales,
            Stored(f"{prefix}.biases", source_dtype, scales.shape, biases, seed_name=scales.name)]


def _row_scale(prefix: str, out_f: int, std: float, rms: float) -> Stored:
    return Stored(f"{prefix}.weight_scale", "F32", (out_f, 1), uniform_fill(std / rms * SPREAD[0],
                                                                            std / rms * SPREAD[1], "F32"))


def int8_tensors(prefix: str, out_f: int, in_f: int, std: float, group_size: int, source_dtype: str) -> list[Stored]:
    """int8: random codes in -127..127 and a random scale per row."""
    codes = Stored(f"{prefix}.weight", "I8", (out_f, in_f), bytes_fill("I8", lambda q: np.maximum(q, -127)))
    return [codes, _row_scale(prefix, out_f, std, INT8_CODE_RMS)]


def fp8_tensors(prefix: str, out_f: int, in_f: int, std: float, group_size: int, source_dtype: str) -> list[Stored]:
    """fp8: random e4m3fn codes of magnitude at most 1.875 (never NaN) and a random scale per row."""
    codes = Stored(f"{prefix}.weight", "F8_E4M3", (out_f, in_f), bytes_fill("U8", _fp8_low))
    return [codes, _row_scale(prefix, out_f, std, _fp8_rms())]


def nf4_tensors(prefix: str, out_f: int, in_f: int, std: float, group_size: int, source_dtype: str) -> list[Stored]:
    """nf4 (bitsandbytes serialization): random codes, a random absmax per block, the code table and the state."""
    from clef_local.quant import nf4

    n = out_f * in_f
    absmax = std / _nf4_rms()
    meta = {"quant_type": "nf4", "blocksize": group_size, "dtype": "bfloat16", "shape": [out_f, in_f]}
    blob = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    return [Stored(f"{prefix}.weight", "U8", ((n + 1) // 2, 1), bytes_fill("U8")),
            Stored(f"{prefix}.weight.absmax", "F32", (math.ceil(n / group_size),),
                   uniform_fill(absmax * SPREAD[0], absmax * SPREAD[1], "F32")),
            Stored(f"{prefix}.weight.quant_map", "F32", (16,), const_fill(np.array(nf4.NF4_CODE, np.float32))),
            Stored(f"{prefix}.{nf4.QUANT_STATE_KEY}", "U8", (blob.size,), const_fill(blob))]


def _seed_of(seed: int, name: str, piece: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode("utf-8")), piece])


def _pieces(tensor: Stored) -> Iterator[tuple[int, int, int]]:
    """(piece index, first element, count) of ``tensor``, :data:`PIECE_BYTES` each."""
    step = max(1, PIECE_BYTES // np.dtype(_NP_DTYPES[tensor.dtype]).itemsize)
    for index, start in enumerate(range(0, tensor.numel, step)):
        yield index, start, min(step, tensor.numel - start)


def _make_piece(tensor: Stored, seed: int, index: int, start: int, count: int) -> np.ndarray:
    values = tensor.fill(_seed_of(seed, tensor.seed_name or tensor.name, index), start, count)
    if values.shape != (count,) or values.dtype.itemsize != np.dtype(_NP_DTYPES[tensor.dtype]).itemsize:
        raise RuntimeError(f"{tensor.name}: a piece came out as {values.dtype} {values.shape}, not {count} values")
    return np.ascontiguousarray(values)


def tensor_values(tensor: Stored, seed: int = 0) -> np.ndarray:
    """All of ``tensor``'s stored values (bit patterns for BF16 / fp8), as :func:`write_safetensors` writes them."""
    return np.concatenate([_make_piece(tensor, seed, *piece) for piece in _pieces(tensor)]).reshape(tensor.shape)


def safetensors_header(tensors: list[Stored], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length and the JSON header (padded with spaces to a multiple of 8) of a file of ``tensors``,
    laid out in the given order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(path: Path, tensors: list[Stored], *, seed: int, workers: int, hashed: bool = True) -> str:
    """Write ``tensors`` to ``path`` piece by piece (module docstring); return the file's SHA-256 ("" unhashed)."""
    import hashlib

    digest = hashlib.sha256() if hashed else None
    in_flight: deque[Future[np.ndarray]] = deque()
    with path.open("wb") as f, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="synthetic") as pool:
        def emit(data: bytes | memoryview) -> None:
            f.write(data)
            if digest is not None:  # hashing costs about as much as writing on a fast disk
                digest.update(data)

        emit(safetensors_header(tensors))
        for tensor in tensors:
            for index, start, count in _pieces(tensor):
                in_flight.append(pool.submit(_make_piece, tensor, seed, index, start, count))
                if len(in_flight) >= 2 * workers:  # bounded: the memory held is a few pieces
                    emit(in_flight.popleft().result().view(np.uint8).data)
        while in_flight:
            emit(in_flight.popleft().result().view(np.uint8).data)
    return digest.hexdigest() if digest is not None else ""


def shaped_config(config: Mapping[str, Any], *, layers: int | None = None, vocab_size: int | None = None,
                  token_ids: Mapping[str, int] | None = None) -> dict[str, Any]:
    """A copy of a backbone ``config.json`` with ``layers`` text decoder layers (the first ones of its
    ``layer_types``; the vision tower keeps at most as many blocks), a smaller ``vocab_size``, and the special token
    ids of the tokenizer that will sit beside it (``token_ids``: the content → id map of its added tokens)."""
    out = json.loads(json.dumps(config))
    text = out.get("text_config") or out
    if layers is not None:
        if not 1 <= layers <= int(text["num_hidden_layers"]):
            raise ValueError(f"layers must be between 1 and {text['num_hidden_layers']}, not {layers}")
        text["num_hidden_layers"] = layers
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:layers]
        if isinstance(out.get("vision_config"), dict) and "depth" in out["vision_config"]:
            out["vision_config"]["depth"] = min(int(out["vision_config"]["depth"]), layers)
    if vocab_size is not None:
        text["vocab_size"] = vocab_size
        if "vocab_size" in out and out is not text:
            out["vocab_size"] = vocab_size
    if token_ids:
        eos, pad = token_ids["<|im_end|>"], token_ids["<|endoftext|>"]
        text.update(eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
        for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                           ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
            if key in out:
                out[key] = token_ids[token]
        if max(token_ids.values()) >= int(text["vocab_size"]):
            raise ValueError(f"vocab_size {text['vocab_size']} is smaller than the tokenizer's ids "
                             f"(up to {max(token_ids.values())})")
    return out


def _meta_model(directory: Path) -> Any:
    """The architecture of ``directory/config.json`` built on the meta device (no memory)."""
    import torch
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    architecture = (getattr(hf_config, "architectures", None) or [""])[0]
    cls = getattr(transformers, architecture, None)
    with torch.device("meta"):
        if cls is not None and hasattr(cls, "_from_config"):
            return cls._from_config(hf_config, dtype=torch.bfloat16)
        return transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)


def _initialized(model: Any, names: list[str], seed: int, dtype: str) -> dict[str, np.ndarray]:
    """The architecture's own ``_init_weights`` values of the small tensors ``names`` (their owner modules'
    other parameters stay on the meta device, where initialising them costs nothing)."""
    import torch

    owners: dict[str, list[str]] = {}
    for name in names:
        owners.setdefault(name.rpartition(".")[0], []).append(name)
    values: dict[str, np.ndarray] = {}
    for owner_name, owned in owners.items():
        module = model.get_submodule(owner_name)
        for name in owned:
            key = name.rpartition(".")[2]
            module._parameters[key] = torch.nn.Parameter(
                torch.empty(module._parameters[key].shape, dtype=torch.float32), requires_grad=False)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed ^ zlib.crc32(owner_name.encode("utf-8")))
            model._init_weights(module)
        for name in owned:
            values[name] = _float_bits(module._parameters[name.rpartition(".")[2]].detach().numpy(), dtype)
    return values


@dataclass(frozen=True)
class Backbone:
    """A backbone's stored tensors (model order), those kept as released (and why), the quantized weights."""

    tensors: list[Stored]
    kept: dict[str, str]
    quantized: list[str]
    quantized_bytes: int


def backbone_tensors(model: Any, config: Mapping[str, Any], scheme: str, *, group_size: int, seed: int) -> Backbone:
    """Every stored tensor of the backbone built on the meta device (``model``) in ``scheme``."""
    import torch

    from clef_local.quant.predicate import should_quantize

    text = config.get("text_config") or config
    dtype = _FLOAT_NAMES.get(str(text.get("dtype") or config.get("dtype") or "bfloat16"), "BF16")
    std = float(text.get("initializer_range") or 0.02)
    vision_std = float((config.get("vision_config") or {}).get("initializer_range") or std)
    pred_group = registry.get(scheme).predicate_group_size(group_size) if scheme in registry.SCHEMES else None
    params = dict(model.named_parameters())
    small = [n for n, p in params.items()
             if not (p.dim() == 2 and isinstance(model.get_submodule(n.rpartition(".")[0]),
                                                 torch.nn.Linear | torch.nn.Embedding))]
    initial = _initialized(model, small, seed, dtype)
    tensors: list[Stored] = []
    kept: dict[str, str] = {}
    quantized: list[str] = []
    quantized_bytes = 0
    for name, param in params.items():
        shape = tuple(param.shape)
        ok, reason = should_quantize(name, shape, pred_group)
        if scheme != "bf16" and ok:
            packed = quantized_tensors(scheme, name, shape[0], shape[1], std, group_size, dtype)
            tensors += packed
            quantized.append(name)
            quantized_bytes += sum(t.nbytes for t in packed)
            continue
        kept[name] = reason
        fill = (const_fill(initial[name]) if name in initial
                else normal_fill(vision_std if ".visual." in f".{name}" else std, dtype))
        tensors.append(Stored(name, dtype, shape, fill))
    return Backbone(tensors, kept, quantized, quantized_bytes)


def head_tensors(config: HeadConfig) -> list[Stored]:
    """A random joint schema head in float32 in which every parameter matters (the rules of
    :func:`clef_local.testing.build_tiny_release`: gates and scales away from zero, norms near 1, small biases,
    matrices as PyTorch initialises linear layers)."""
    from clef_local.formats.head_config import head_tensor_shapes

    tensors = []
    for name, shape in head_tensor_shapes(config).items():
        if name in ("prior_logit_scale", "joint_logit_scale"):
            fill = uniform_fill(0.5, 2.0, "F32")
        elif name == "residual_gate":
            fill = uniform_fill(0.3, 1.0, "F32", random_sign=True)
        elif "norm" in name and name.endswith("weight"):
            fill = _plus_one(normal_fill(0.2, "F32"))
        elif name.endswith("bias"):
            fill = normal_fill(0.1, "F32")
        else:
            bound = 1 / math.sqrt(shape[-1])
            fill = uniform_fill(-bound, bound, "F32")
        tensors.append(Stored(name, "F32", tuple(shape), fill))
    return tensors


def _plus_one(fill: Fill) -> Fill:
    return lambda rng, start, count: fill(rng, start, count) + np.float32(1)


def shard_plan(tensors: list[Stored], shard_bytes: int) -> list[list[Stored]]:
    """Consecutive runs of ``tensors`` of at most ``shard_bytes`` each (a larger tensor alone in its shard)."""
    shards: list[list[Stored]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def _quantization_config(scheme: str, group_size: int, model: Any, backbone: Backbone) -> dict[str, Any]:
    """``quantization_config`` as ``clef-local quantize`` writes it, marked synthetic (the grid is random codes)."""
    import torch

    spec = registry.get(scheme)
    group = group_size if spec.default_group_size is not None else None
    done = {n.removesuffix(".weight") for n in backbone.quantized}
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    qconfig = spec.quantization_config(group, skip_modules=[m for m in linear if m not in done])
    if "grid" in spec.options:  # the scheme records how its grid was chosen: here, random codes
        qconfig["grid"] = "random"
    qconfig["clef_local"] = {"scheme": scheme, "group_size": group, "quantized": len(backbone.quantized),
                             "skipped": backbone.kept, "synthetic": True}
    return qconfig


def write_shaped_weights(config_path: str | Path, out: str | Path, *, scheme: str = "bf16",
                         layers: int | None = None, vocab_size: int | None = None, seed: int = 0,
                         token_ids: Mapping[str, int] | None = None, head_config: str | Path | None = None,
                         group_size: int = 64, shard_bytes: int = DEFAULT_SHARD_BYTES,
                         workers: int | None = None, hashes: bool = True) -> Path:
    """Write the backbone shards (+ index), ``config.json``, ``generation_config.json``, the joint head and, last,
    ``clef_local_manifest.json`` (every file in ``out``, SHA-256 included) of a random release shaped like
    ``config_path`` into the existing directory ``out``; return ``out``.

    ``head_config`` defaults to ``NAME.joint_head_config.json`` or ``joint_head_config.json`` beside the config;
    its ``hidden_size`` must match the backbone's. ``layers`` / ``vocab_size`` / ``token_ids``: see
    :func:`shaped_config`. ``group_size``: int4 group (32/64/128) or nf4 block. ``workers``: generating threads
    (default: the usable cores). ``hashes=False`` leaves the weight files' SHA-256 out of the manifest (sizes and
    headers are still checked on load). The tokenizer and the legal files are the caller's.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    sizes = registry.get(scheme).group_sizes if scheme in registry.SCHEMES else None
    allowed = sizes or "32, 64, 128, ... (a power of two >= 32)"
    if group_size not in sizes if sizes else group_size < 32 or group_size & (group_size - 1):
        raise ValueError(f"{scheme} group_size must be one of {allowed}, not {group_size}")
    config_path, out = Path(config_path), Path(out)
    head_path = Path(head_config) if head_config else head_config_beside(config_path)
    if head_path is None:
        raise ValueError(f"no joint head config beside {config_path}; pass head_config=")
    head = read_head_config(head_path)
    config = shaped_config(read_json(config_path), layers=layers, vocab_size=vocab_size, token_ids=token_ids)
    text = config.get("text_config") or config
    if head.hidden_size != int(text["hidden_size"]):
        raise ValueError(f"{head_path}: hidden_size {head.hidden_size} does not match the backbone's "
                         f"{text['hidden_size']} ({config_path})")
    workers = workers or len(os.sched_getaffinity(0))
    write_json(out / "config.json", config)  # the plain config first: the architecture is built from it
    model = _meta_model(out)
    backbone = backbone_tensors(model, config, scheme, group_size=group_size, seed=seed)
    shards = shard_plan(backbone.tensors, shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    digests: dict[str, str] = {}
    for file_name, shard in zip(names, shards, strict=True):
        log.info("writing %s (%d tensors, %.2f GiB)", out / file_name, len(shard), sum(t.nbytes for t in shard) / GiB)
        digests[file_name] = write_safetensors(out / file_name, shard, seed=seed, workers=workers, hashed=hashes)
    digests["joint_head.safetensors"] = write_safetensors(out / "joint_head.safetensors", head_tensors(head),
                                                          seed=seed + 1, workers=workers, hashed=hashes)
    shutil.copyfile(head_path, out / "joint_head_config.json")
    if len(shards) > 1:
        write_json(out / "model.safetensors.index.json", {
            "metadata": {"total_size": sum(t.nbytes for t in backbone.tensors)},
            "weight_map": dict(sorted((t.name, f) for f, shard in zip(names, shards, strict=True) for t in shard))})
    if scheme != "bf16":
        config["quantization_config"] = _quantization_config(scheme, group_size, model, backbone)
        config.update(registry.get(scheme).top_level_config(group_size))
        write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {"eos_token_id": text.get("eos_token_id"),
                                           "pad_token_id": text.get("pad_token_id")})
    files: dict[str, dict[str, Any]] = {name: {"size": (out / name).stat().st_size} for name in list_files(out)}
    for name, entry in files.items():
        if name not in digests or digests[name]:
            entry["sha256"] = digests.get(name) or sha256(out / name)
    grouped = scheme in registry.SCHEMES and registry.get(scheme).default_group_size is not None
    group = group_size if grouped else None
    fields: dict[str, Any] = {"tool": "clef-local", "synthetic": {
        "config": config_path.name, "scheme": scheme, "layers": layers, "vocab_size": vocab_size, "seed": seed,
        "group_size": group}}
    if scheme != "bf16":
        fields["scheme"] = {"name": scheme, "group_size": group, "bits_per_weight": round(
            8 * backbone.quantized_bytes / sum(math.prod(model.get_parameter(n).shape) for n in backbone.quantized),
            4)}
    write_manifest(out, files=files, quantized=backbone.quantized, skipped=backbone.kept, **fields)
    return out


