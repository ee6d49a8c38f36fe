"""The ecosystem's variants read here: a release whose backbone ``mlx_lm.convert -q`` converted loads on the torch
and MLX backends and answers like clef-local's own int4 of the same weights (docs/quantization.md).

mlx-lm's conversion differs from ``clef-local quantize --format int4 --int4-grid mlx`` only in its embeddings (it
quantizes ``embed_tokens`` too; clef-local keeps them as released): the linears are the same bits, asserted below.
Tolerances, float32: torch vs MLX on the conversion max |Δp| ≤ 1e-4 (tests/test_mlx_backend.py's); the conversion vs
clef-local's int4 max |Δp| ≤ 0.05 and no flip on the probe set (the int4 embedding rows alone differ).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import clef_local
from clef_local.formats.safetensors import read_arrays
from clef_local.formats.variant import variant_format
from clef_local.planning.load_options import LoadOptions

GROUP = 64
HEAD_FILES = ("joint_head.safetensors", "joint_head_config.json")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> tuple[Path, Path]:
    """(the mlx-lm conversion of tiny llama with its Clef head, clef-local's int4 of the same source, mlx grid)."""
    from mlx_lm import convert

    from clef_local.export.quantize import quantize_release

    root = tmp_path_factory.mktemp("mlx-lm")
    converted = root / "mlx-lm-4bit"
    convert(str(tiny_llama), str(converted), quantize=True, q_group_size=GROUP, q_bits=4)
    for name in HEAD_FILES:  # mlx-lm copies the backbone and tokenizer; the head travels beside them
        shutil.copyfile(tiny_llama / name, converted / name)
    ours = root / "clef-local-int4"
    quantize_release(tiny_llama, ours, "int4", GROUP, validate=False, int4_grid="mlx", log_summary=False)
    return converted, ours


@pytest.fixture(scope="module")
def probes() -> list[dict]:
    from clef_local.data.probes import probe_requests

    return probe_requests(6, seed=5)


def _probabilities(path: Path, backend: str, requests: list[dict]) -> list[np.ndarray]:
    model = clef_local.load(path, backend=backend, dtype="float32", device="cpu")
    return [p for r in model.predict(requests, batch_size=4) for p in r.probabilities]


def test_the_conversion_is_read_as_mlx_lm_int4_with_the_same_linears(pair):
    converted, ours = pair
    config = json.loads((converted / "config.json").read_text())
    fmt = variant_format(config)
    assert (fmt.scheme, fmt.group_size, fmt.writer) == ("int4", GROUP, "mlx-lm")
    assert fmt.label == f"int4 g{GROUP} (mlx affine, written by mlx-lm)"
    theirs = {k: v for f in converted.glob("model*.safetensors") for k, v in read_arrays(f).items()}
    mine = read_arrays(ours / "model.safetensors")
    linears = sorted(k.removesuffix(".scales") for k in mine if k.endswith(".scales"))
    assert linears and all(k.startswith("model.layers.") for k in linears)
    for prefix in linears:
        for part in ("weight", "scales", "biases"):
            np.testing.assert_array_equal(theirs[f"{prefix}.{part}"], mine[f"{prefix}.{part}"])
    assert "model.embed_tokens.scales" in theirs and "model.embed_tokens.scales" not in mine


def test_inspect_names_the_format_and_the_tool_that_wrote_it(pair, capsys):
    from clef_local.decide import inspect_main

    for path, writer in zip(pair, ("mlx-lm", "clef-local"), strict=True):
        assert inspect_main(["--model", str(path), "--dtype", "float32", "--backend", "torch"]) == 0
        assert json.loads(capsys.readouterr().out)["format"] == {"scheme": "int4", "group_size": GROUP,
                                                                 "layout": "mlx affine", "written_by": writer}


def test_the_conversion_answers_on_both_backends_like_clef_locals_int4(pair, probes):
    converted, ours = pair
    torch_p = _probabilities(converted, "torch", probes)
    mlx_p = _probabilities(converted, "mlx", probes)
    own = _probabilities(ours, "torch", probes)
    assert max(float(np.abs(a - b).max()) for a, b in zip(torch_p, mlx_p, strict=True)) <= 1e-4
    assert max(float(np.abs(a - b).max()) for a, b in zip(torch_p, own, strict=True)) <= 0.05


def test_with_the_same_embedding_rows_clef_locals_int4_answers_exactly_like_the_conversion(pair, probes, tmp_path):
    """clef-local's int4 with its embedding replaced by the conversion's dequantized int4 rows (float32): then the
    two hold the same numbers everywhere, and the probabilities agree to float32 rounding."""
    import torch
    from safetensors.torch import load_file, save_file

    from clef_local.quant import int4

    converted, ours = pair
    theirs = {k: v for f in converted.glob("model*.safetensors") for k, v in load_file(f).items()}
    packed = {part: theirs[f"model.embed_tokens.{part}"] for part in ("weight", "scales", "biases")}
    swapped = shutil.copytree(ours, tmp_path / "swapped", ignore=shutil.ignore_patterns("clef_local_manifest.json"))
    tensors = load_file(ours / "model.safetensors")
    tensors["model.embed_tokens.weight"] = int4.dequantize(packed, GROUP, torch.float32)
    save_file(tensors, swapped / "model.safetensors")
    a, b = _probabilities(converted, "torch", probes), _probabilities(swapped, "torch", probes)
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True)) <= 1e-5


def test_a_streamed_run_of_the_conversion_is_refused_by_name_before_loading(pair):
    """Streaming reads tensors as stored, and the conversion's int4 embeddings are dequantized at load: asked for, it
    is refused; under a cap its resident plan does not fit, "auto" refuses naming why instead of planning a stream
    (drift, eval and validation would have failed at load, after the plan said it would run)."""
    from clef_local.backends.loader import plan_backend
    from clef_local.errors import ApiUsageError, InsufficientMemoryError
    from clef_local.formats.release import read_release

    converted, _ = pair
    with pytest.raises(ApiUsageError, match=r"cannot be streamed from disk: its embeddings are int4 \(an mlx-lm "
                                            r"conversion\), dequantized at load; load it without offload"):
        clef_local.load(converted, dtype="float32", offload="disk")
    release = read_release(converted)
    need = plan_backend(release, LoadOptions(dtype="float32", device="cpu", state_cache=0)).need_bytes
    with pytest.raises(InsufficientMemoryError, match=r"cannot be streamed from disk \(its embeddings are int4"):
        plan_backend(release, LoadOptions(dtype="float32", device="cpu", state_cache=0, offload="auto",
                                          max_memory=f"cpu={need * 9 // 10}"))


def test_the_plan_counts_the_embeddings_as_the_loaders_hold_them(pair):
    """The loaders dequantize the conversion's int4 embeddings: the plan counts those matrices (in float32, the
    loaded tensors' bytes, on torch and MLX), not the stored 4-bit ones, so a memory cap between the two figures
    does not fit."""
    from clef_local.planning.caps import with_cap
    from clef_local.planning.estimate import held_weights, plan
    from clef_local.planning.hardware import detect
    from clef_local.planning.planner import footprint_from_release

    converted, _ = pair
    footprint = footprint_from_release(converted)
    census = footprint.censuses["int4"]
    held = held_weights(census, "float32")
    stored = sum(v.nbytes for f in converted.glob("model*.safetensors") for k, v in read_arrays(f).items()
                 if k.startswith(("model.embed_tokens.", "lm_head.")))
    backbone = clef_local.load(converted, backend="torch", dtype="float32", device="cpu").backend.backbone.model
    embed, output = backbone.get_input_embeddings().weight, backbone.get_output_embeddings().weight
    loaded = embed.nbytes + (0 if output is embed else output.nbytes)
    assert held.embed_tokens == embed.nbytes == embed.numel() * 4
    assert held.embed_tokens + held.lm_head == loaded > 4 * stored  # 4-bit codes and bf16 scales, 1/6 the size
    mlx = clef_local.load(converted, backend="mlx", dtype="float32", device="cpu").backend.backbone
    assert held.embed_tokens == mlx.text.embed_tokens.weight.nbytes
    cpu = detect("cpu")
    need = plan(census, footprint.dims, cpu, context=4096, dtype="float32").need
    between = need - (loaded - stored) // 2  # above what counting the stored embeddings would need
    assert not plan(census, footprint.dims, with_cap(cpu, between), context=4096, dtype="float32").fits
    assert plan(census, footprint.dims, with_cap(cpu, need), context=4096, dtype="float32").fits
