"""The memory planner: exact weight bytes from headers, scheme formulas against real exports, config census,
activation formula terms, and the plan command."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from clef_local.formats.release import read_release
from clef_local.formats.safetensors import read_header
from clef_local.planning.census import census_from_release
from clef_local.planning.estimate import ModelDims, activations, best_fit, max_context, plan
from clef_local.planning.hardware import named_device
from clef_local.planning.planner import (
    CONFIGS_DIR,
    footprint_from_config,
    footprint_from_release,
    main,
    packaged_config,
    resolve_config,
)
from clef_local.units import GiB

CONFIGS = CONFIGS_DIR  # the packaged Clef / Clef-flash shapes


def _stored_bytes(files: list[Path]) -> int:
    """The sum of every tensor's numel × element size, read through safetensors itself."""
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                tensor = handle.get_tensor(name)
                total += tensor.numel() * tensor.element_size()
    return total


@pytest.fixture(scope="module")
def tiny_variants(tmp_path_factory: pytest.TempPathFactory, tiny_qwen: Path) -> dict[str, Path]:
    from clef_local.export.quantize import quantize_release
    from clef_local.quant import nf4

    out = {}
    # fp8 stores exactly what int8 does (one byte per weight + a float32 scale per row): int8 covers its formula
    for scheme in ("int4", "int8", *(("nf4",) if nf4.bitsandbytes_available() else ())):
        out[scheme] = tmp_path_factory.mktemp("variant") / scheme
        quantize_release(tiny_qwen, out[scheme], scheme, validate=False, log_summary=False)
    return out


def test_weight_bytes_of_a_tiny_release_are_exact(tiny_qwen: Path) -> None:
    release = read_release(tiny_qwen)
    census = census_from_release(release.path, release.weight_files, release.config)
    assert census.exact and census.fmt == "bf16"
    assert census.backbone == _stored_bytes(list(release.weight_files))
    assert census.vision > 0 and census.embed_tokens > 0 and census.quantized_linears > 0
    head = read_header(tiny_qwen / "joint_head.safetensors").tensors
    assert census.head == 4 * sum(math.prod(t.shape) for t in head.values())


def test_scheme_formulas_equal_the_exported_variants(tiny_qwen: Path, tiny_variants: dict[str, Path]) -> None:
    release = read_release(tiny_qwen)
    for scheme, path in tiny_variants.items():
        variant = read_release(path)
        stored = census_from_release(variant.path, variant.weight_files, variant.config)
        assert stored.fmt == scheme and stored.exact
        assert stored.backbone == _stored_bytes(list(variant.weight_files)), scheme
        predicted = census_from_release(release.path, release.weight_files, release.config, scheme)
        assert predicted.quantized_linears == stored.quantized_linears, scheme
        assert predicted.backbone == stored.backbone, scheme


def test_a_variant_cannot_be_planned_in_another_format(tiny_variants: dict[str, Path]) -> None:
    from clef_local.errors import ReleaseError

    variant = read_release(tiny_variants["int8"])
    with pytest.raises(ReleaseError, match=r"int8 variant.*--model SOURCE --format int4"):
        census_from_release(variant.path, variant.weight_files, variant.config, "int4")
    assert set(footprint_from_release(variant.path).censuses) == {"int8"}


@pytest.mark.slow
def test_weight_bytes_of_the_demo_model_are_exact(demo_release: Path) -> None:
    release = read_release(demo_release)
    census = census_from_release(release.path, release.weight_files, release.config)
    assert census.exact and census.backbone == _stored_bytes(list(release.weight_files))
    assert census.lm_head == 0  # SmolLM2 ties lm_head to embed_tokens


def test_config_census_matches_design_facts() -> None:
    flash = footprint_from_config(CONFIGS / "clef-flash.config.json", ("bf16", "int4")).censuses
    params = flash["bf16"].params
    assert params["text_linears"] == pytest.approx(6.92e9, rel=0.005)
    assert params["embed_tokens"] == params["lm_head"] == pytest.approx(1.02e9, rel=0.005)
    assert params["vision"] == pytest.approx(0.46e9, rel=0.02)
    assert sum(params.values()) == pytest.approx(9.41e9, rel=0.005)
    assert flash["bf16"].head / 4 == pytest.approx(122e6, rel=0.02)
    big = footprint_from_config(CONFIGS / "clef.config.json", ("int4",)).censuses["int4"]
    on_device = big.device_weights(host_embeddings=True, media=False)
    assert 13 * 1e9 <= on_device <= 15.5 * 1e9  # docs/hardware.md: a 4-bit Clef needs ~14–15 GB on the device


def test_activation_terms_for_a_llama() -> None:
    dims = ModelDims(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64, head_width=256)
    acts = activations(dims, 2048, 1, "float32")
    # 4 hidden-sized tensors live through a layer, plus the gated MLP's three intermediates, plus rotary cos/sin
    assert acts.per_token == 4 * 576 * 4 + 3 * 1536 * 4 and acts.dominant == "mlp"
    assert acts.total == 2048 * acts.per_token + 2048 * 2 * 64 * 4
    padded = activations(dims, 2048, 4, "float32")
    assert padded.mask == 4 * 2048**2  # a boolean padding mask once records are padded together
    assert activations(dims, 2048, 1, "bfloat16").per_token < acts.per_token


def test_qwen3_5_linear_attention_dominates_the_torch_prefill() -> None:
    footprint = footprint_from_config(CONFIGS / "clef-flash.config.json", ("bf16",))
    acts = activations(footprint.dims, 16384, 1, "bfloat16")
    assert footprint.dims.linear_layers == 24 and acts.dominant == "linear"
    assert 2 * GiB < acts.total < 6 * GiB


def test_best_fit_and_max_context_on_named_devices() -> None:
    footprint = footprint_from_config(CONFIGS / "clef.config.json")
    card = named_device("rtx4090")
    plans = footprint.plans(card, context=8192)
    assert not plans["bf16"].fits and not plans["int8"].fits and plans["int4"].fits
    assert best_fit(plans).fmt == "int4"
    assert best_fit(footprint.plans(named_device("h200"), context=16384)).fmt == "bf16"
    longest = max_context(footprint.censuses["int4"], footprint.dims, card)
    assert plan(footprint.censuses["int4"], footprint.dims, card, context=longest).fits
    assert not plan(footprint.censuses["int4"], footprint.dims, card, context=longest + 256).fits


def test_plan_command_resolves_the_packaged_config_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert resolve_config("clef") == packaged_config("clef") == CONFIGS_DIR / "clef.config.json"
    assert resolve_config("clef-flash").is_file() and (CONFIGS_DIR / "clef-flash.joint_head_config.json").is_file()
    assert resolve_config(str(CONFIGS_DIR / "clef.config.json")) == CONFIGS_DIR / "clef.config.json"  # a path works
    assert main(["--config", "clef-flash", "--device", "h100", "--context", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "clef-flash" and out["best"] == "bf16"
    assert main(["--config", str(CONFIGS_DIR / "clef.config.json"), "--device", "rtx4090"]) == 0
    assert "best precision that fits: int4" in capsys.readouterr().out
    assert main(["--config", "clef-max", "--device", "h100"]) == 2
    err = capsys.readouterr().err
    assert "unknown config 'clef-max'" in err and "clef, clef-flash" in err
    with pytest.raises(ValueError, match="packaged ones are clef, clef-flash"):
        packaged_config("clef.config.json")


def test_plan_command_on_a_tiny_release(tiny_qwen: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tiny_qwen), "--device", "cpu-8", "--context", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["format"] for p in out["plans"]] == ["bf16", "int8", "fp8", "int4", "nf4"]
    assert out["best"] == "bf16" and out["plans"][0]["weights_exact"]
    assert main(["--model", str(tiny_qwen), "--device", "rtx4090", "--format", "int4", "--explain"]) == 0
    text = capsys.readouterr().out
    assert "best precision that fits: int4" in text and "N × " in text and "on cuda:0" in text


def test_plan_command_says_when_nothing_fits(tiny_qwen: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tiny_qwen), "--device", "0.4GB", "--context", "512"]) == 1
    assert "nothing fits" in capsys.readouterr().out
    assert main(["--model", str(tiny_qwen), "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_the_planner_and_the_loaders_choice_need_no_torch(tiny_qwen: Path) -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "from clef_local.planning.hardware import named_device\n"
            "from clef_local.planning.choice import plan_load\n"
            "from clef_local.planning.planner import footprint_from_release\n"
            f"fp = footprint_from_release({str(tiny_qwen)!r})\n"
            "d = plan_load(named_device('mac-36'), 'bf16', fp, context=512, installed={'torch': 'no', 'mlx': None, "
            "'onnx': 'no'})\n"
            "assert d.backend == 'mlx' and d.need_bytes > fp.censuses['bf16'].backbone, d\n"
            "print(sorted(fp.censuses))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['bf16', 'fp8', 'int4', 'int8', 'nf4']"
