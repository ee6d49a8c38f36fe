"""``clef-local quantize``: variant layout, exactness, sizes, safety (refusals, interruption) and corruption checks."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from clef_local import quant
from clef_local.errors import ReleaseError
from clef_local.export.quantize import ExportError, main, quantize_release, summary_lines
from clef_local.formats.manifest import MANIFEST, check_files, read_manifest, verify
from clef_local.formats.manifest import main as verify_main
from clef_local.formats.release import read_release
from clef_local.quant.predicate import NOT_DIVISIBLE, should_quantize
from clef_local.testing import build_tiny_release

SCHEMES = [("int4", 32), ("int4", 64), ("int8", None), ("nf4", None), ("fp8", None)]
KEYS = {"int4": {"weight", "scales", "biases"}, "int8": {"weight", "weight_scale"}, "fp8": {"weight", "weight_scale"},
        "nf4": {"weight", "weight.absmax", "weight.quant_map", "weight.quant_state.bitsandbytes__nf4"}}
COPIED = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
          "chat_template.jinja", "joint_head.safetensors", "joint_head_config.json", "joint_schema_model.py",
          "LICENSE", "NOTICE", "generation_config.json")


def hashes(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("model*.safetensors")):
        out.update(load_file(file))
    return out


def siblings(out: Path) -> list[Path]:
    return sorted(p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {"llama": build_tiny_release(root / "llama", "llama", seed=3),
            "qwen3_5": build_tiny_release(root / "qwen3_5", "qwen3_5", seed=4, shards=3)}


@pytest.fixture(scope="module")
def variants(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, tuple[Path, dict]]:
    """Every scheme on both backbones, exported once (validation off: it has its own tests)."""
    root = tmp_path_factory.mktemp("variants")
    before = {name: hashes(path) for name, path in sources.items()}
    out = {}
    for backbone, source in sources.items():
        for scheme, group in SCHEMES:
            target = root / f"{backbone}-{scheme}-{group}"
            out[backbone, scheme, group] = target, quantize_release(source, target, scheme, group, validate=False)
    assert {name: hashes(path) for name, path in sources.items()} == before  # the source is only read
    return out


@pytest.mark.parametrize("backbone", ["llama", "qwen3_5"])
@pytest.mark.parametrize(("scheme", "group"), SCHEMES)
def test_variant_layout_and_exactness(sources, variants, backbone: str, scheme: str, group: int | None) -> None:
    source = sources[backbone]
    variant, summary = variants[backbone, scheme, group]
    spec = quant.get(scheme)
    src_hashes, var_hashes = hashes(source), hashes(variant)
    for name in COPIED:  # head, tokenizer and legal files byte for byte
        assert var_hashes[name] == src_hashes[name], name
    assert set(var_hashes) == set(src_hashes) | {MANIFEST, "validation.json"}
    # written with validate=False: both the config and validation.json say so
    assert json.loads((variant / "validation.json").read_text()) == {"validated": False, "skipped": "--no-validate"}
    weight_files = sorted(p.name for p in source.glob("model*.safetensors"))
    assert sorted(p.name for p in variant.glob("model*.safetensors")) == weight_files

    src_config = json.loads((source / "config.json").read_text())
    config = json.loads((variant / "config.json").read_text())
    qconfig = config.pop("quantization_config")
    # int4 also carries mlx-lm's block, which mlx-lm reads before quantization_config
    assert config.pop("quantization", None) == spec.top_level_config(group).get("quantization")
    assert config == src_config
    assert qconfig["clef_local"]["scheme"] == scheme and qconfig["clef_local"]["quantized"] == summary["quantized"]
    assert qconfig["clef_local"]["validated"] is False
    assert read_release(variant).quantization == qconfig

    manifest = read_manifest(variant)
    assert manifest["scheme"]["name"] == scheme and manifest["scheme"]["group_size"] == (group or
                                                                                          spec.default_group_size)
    assert manifest["source"]["files"].keys() == src_hashes.keys()
    assert all(manifest["files"][n]["sha256"] == h for n, h in var_hashes.items() if n != MANIFEST)
    assert verify(variant) == [] and check_files(variant) == []

    src, out = tensors(source), tensors(variant)
    quantized = set(manifest["quantized"])
    assert quantized and len(quantized) == summary["quantized"]
    assert set(manifest["skipped"]) == set(src) - quantized
    g = manifest["scheme"]["group_size"]
    for name, weight in src.items():
        assert not (name in quantized and any(k in name for k in ("embed", "lm_head", "norm", "visual")))
        if name not in quantized:
            assert out[name].dtype == weight.dtype and torch.equal(out[name], weight), name
            continue
        prefix = name.removesuffix(".weight")
        packed = {k: out[f"{prefix}.{k}"] for k in KEYS[scheme]}
        assert not {k for k in out if k.startswith(prefix + ".")} - {f"{prefix}.{k}" for k in KEYS[scheme]}
        deq = spec.dequantize(packed, g, torch.float32)
        w = weight.float()
        err = (deq - w).abs()
        assert deq.shape == w.shape
        if scheme == "int4":  # the mse grid (the default): per group never above MLX's own grid
            assert qconfig["grid"] == qconfig["clef_local"]["grid"] == "mse"
            mlx = spec.dequantize(spec.quantize(weight, g, grid="mlx"), g, torch.float32)
            ours_sse, mlx_sse = ((r - w).square().reshape(w.shape[0], -1, g).sum(-1) for r in (deq, mlx))
            assert (ours_sse <= mlx_sse).all(), name
        elif scheme == "int8":
            assert (err <= packed["weight_scale"] / 2 * 1.00001 + 1e-8).all(), name
        elif scheme == "fp8":
            assert (err <= 2**-4 * w.abs() + 2**-10 * packed["weight_scale"] + 1e-7).all(), name
        else:  # nf4: half the widest gap of the code (0.304 / 2) of each block's absmax
            absmax = packed["weight.absmax"].repeat_interleave(64)[: w.numel()].reshape(w.shape)
            assert (err <= 0.16 * absmax + 1e-7).all(), name


@pytest.mark.parametrize("backbone", ["llama", "qwen3_5"])
def test_sizes_from_the_manifest(variants, backbone: str) -> None:
    limits = {("int4", 64): 0.30, ("nf4", None): 0.30, ("int8", None): 0.53, ("fp8", None): 0.53}
    for (scheme, group), limit in limits.items():
        variant, summary = variants[backbone, scheme, group]
        b = read_manifest(variant)["bytes"]
        assert b == summary["bytes"]
        assert b["linear_after"] <= limit * b["linear_before"], (scheme, b)
        assert b["total_after"] < b["total_before"]
        assert b["total_after"] == sum(p.stat().st_size for p in variant.iterdir() if p.name != MANIFEST)


def test_sharded_index_is_rewritten(sources, variants) -> None:
    variant, _ = variants["qwen3_5", "int4", 64]
    index = json.loads((variant / "model.safetensors.index.json").read_text())
    src_index = json.loads((sources["qwen3_5"] / "model.safetensors.index.json").read_text())
    stored = {}
    for file in sorted(variant.glob("model-*.safetensors")):
        with safe_open(str(file), "pt") as f:
            stored.update(dict.fromkeys(f.keys(), file.name))
    assert index["weight_map"] == stored
    assert index["metadata"]["total_parameters"] == src_index["metadata"]["total_parameters"]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors(variant).values())


def test_nf4_variant_reloads_in_transformers(sources, variants) -> None:
    """transformers' own bitsandbytes support reloads the nf4 backbone: exactly our tensors become Linear4bit."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    variant, _ = variants["llama", "nf4", None]
    model = AutoModelForCausalLM.from_pretrained(variant, device_map="cpu")
    swapped = {n + ".weight" for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert swapped == set(read_manifest(variant)["quantized"])
    src = tensors(sources["llama"])
    for name, param in model.state_dict().items():
        if name in src and name not in swapped:
            assert torch.equal(param, src[name]), name
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3, 4]])).logits).all()


def test_layer_not_divisible_by_group_is_kept(tmp_path: Path) -> None:
    from transformers import AutoConfig, LlamaForCausalLM

    source = build_tiny_release(tmp_path / "src", "llama", seed=5)
    config = AutoConfig.from_pretrained(source)
    config.intermediate_size = 96  # down_proj has in_features 96: not a multiple of 64
    (source / "model.safetensors").unlink()
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(source)
    summary = quantize_release(source, tmp_path / "int4", "int4", 64, validate=False)
    down = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)]
    assert all(summary["skipped"][n] == NOT_DIVISIBLE for n in down)
    assert summary["skipped_by_reason"][NOT_DIVISIBLE] == 2
    assert json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]["clef_local"][
        "skipped"][down[0]] == NOT_DIVISIBLE
    assert torch.equal(tensors(tmp_path / "int4")[down[0]], tensors(source)[down[0]])
    g32 = quantize_release(source, tmp_path / "int4-g32", "int4", 32, validate=False)
    assert all(n not in g32["skipped"] for n in down)  # 96 % 32 == 0


def test_refusals_force_and_source_untouched(sources, tmp_path: Path) -> None:
    source = sources["llama"]
    before = hashes(source)
    out = tmp_path / "variant"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(ExportError, match="exists"):
        quantize_release(source, out, "int8", validate=False)
    assert (out / "keep.txt").read_text() == "old" and not siblings(out)
    quantize_release(source, out, "int8", force=True, validate=False)
    assert not (out / "keep.txt").exists() and verify(out) == [] and not siblings(out)
    for bad in (source, source / "sub", source.parent):  # equal, inside, containing the source
        with pytest.raises(ExportError, match="source"):
            quantize_release(source, bad, "int4", force=True, validate=False)
    with pytest.raises(ExportError, match="group-size"):
        quantize_release(source, tmp_path / "g", "int4", 48, validate=False)
    with pytest.raises(ExportError, match="group-size"):
        quantize_release(source, tmp_path / "g", "int8", 64, validate=False)
    with pytest.raises(ExportError, match="already quantized"):
        quantize_release(out, tmp_path / "again", "int4", validate=False)
    with pytest.raises(ExportError, match="int4-grid applies to int4 only"):
        quantize_release(source, tmp_path / "g", "nf4", int4_grid="mlx", validate=False)
    with pytest.raises(ExportError, match="int4-grid must be one of"):
        quantize_release(source, tmp_path / "g", "int4", int4_grid="gptq", validate=False)
    assert hashes(source) == before and not (tmp_path / "g").exists()


def test_cli_quantize_bits_and_summary(sources, tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli"
    assert main(["--model", str(sources["llama"]), "--bits", "4", "--out", str(out), "--no-validate"]) == 0
    printed = capsys.readouterr().out
    assert "int4 g64" in printed and "quantized linear weights" in printed and "embedding: 1 tensor" in printed
    assert read_manifest(out)["scheme"]["name"] == "int4"
    assert main(["--model", str(sources["llama"]), "--bits", "8", "--out", str(out), "--no-validate"]) == 2
    assert "exists" in capsys.readouterr().err


def test_cli_int4_grid_mlx_writes_what_mx_quantize_writes(sources, tmp_path: Path, capsys) -> None:
    out = tmp_path / "mlx-grid"
    assert main(["--model", str(sources["llama"]), "--bits", "4", "--int4-grid", "mlx", "--out", str(out),
                 "--no-validate"]) == 0
    assert "int4 g64 (mlx grid)" in capsys.readouterr().out
    qconfig = read_release(out).quantization
    assert qconfig["grid"] == qconfig["clef_local"]["grid"] == "mlx"
    src, written = tensors(sources["llama"]), tensors(out)
    for name in read_manifest(out)["quantized"]:
        expected = quant.int4.quantize(src[name], 64, grid="mlx")
        assert all(torch.equal(written[f"{name.removesuffix('.weight')}.{k}"], v) for k, v in expected.items())


def test_sigkill_at_random_points_leaves_nothing_half_written(tmp_path: Path) -> None:
    source = build_tiny_release(tmp_path / "src", "qwen3_5", seed=6, shards=8)
    before = hashes(source)
    out = tmp_path / "variant"
    env = dict(os.environ)
    # 30 ms after each of 77 tensors: ~2.3 s of export after the temp directory appears
    script = ("import sys, time; from pathlib import Path; from clef_local.export.quantize import quantize_release; "
              "quantize_release(Path(sys.argv[1]), Path(sys.argv[2]), 'int4', validate=False, "
              "on_tensor=lambda _: time.sleep(0.03))")
    cmd = [sys.executable, "-c", script, str(source), str(out)]
    rng = random.Random(20261130)
    points = sorted(rng.uniform(0.0, 2.0) for _ in range(5))
    written: list[int] = []  # output shards in the temp directory at each kill
    for point in points:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 60
            while not any(".tmp-" in p.name and str(proc.pid) in p.name for p in siblings(out)):
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline
                time.sleep(0.005)
            time.sleep(point)
            assert proc.poll() is None, f"the export finished before the kill at {point:.2f} s"
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        assert not out.exists()
        written.append(len(list(siblings(out)[0].glob("*.safetensors"))) if siblings(out) else -1)
        assert len(siblings(out)) == 1  # this run's temp; the previous run's was cleaned at start
        assert hashes(source) == before
    print(f"SIGKILL at {', '.join(f'{t:.2f}' for t in points)} s: output shards written {written}")
    summary = quantize_release(source, out, "int4", validate=False)
    assert summary["quantized"] == 25 and verify(out) == [] and not siblings(out)
    assert hashes(source) == before


def _data_offset(file: Path) -> int:
    return 8 + int.from_bytes(file.read_bytes()[:8], "little")


def test_flipped_byte_and_truncated_shard_are_named(variants, tmp_path: Path, capsys) -> None:
    variant = shutil.copytree(variants["qwen3_5", "int8", None][0], tmp_path / "v")
    assert verify_main([str(variant)]) == 0
    assert capsys.readouterr().out.strip() == f"ok: {len(read_manifest(variant)['files'])} files verified"
    shard = variant / "model-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[_data_offset(shard) + 100] ^= 0x01
    shard.write_bytes(bytes(data))
    read_release(variant)  # the cheap load check cannot see a flipped bit; verify can
    assert verify(variant) == [f"{shard}: SHA-256 differs from {MANIFEST}"]
    assert verify_main([str(variant)]) == 1
    assert shard.name in capsys.readouterr().out
    cli = subprocess.run([sys.executable, "-m", "clef_local.cli", "verify", str(variant)], capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 1 and shard.name in cli.stdout

    other = variant / "model-00003-of-00003.safetensors"
    with other.open("r+b") as f:
        f.truncate(other.stat().st_size - 10)
    with pytest.raises(ReleaseError, match=other.name) as info:
        read_release(variant)
    assert "truncated" in str(info.value) and shard.name not in str(info.value)
    import clef_local

    with pytest.raises(ReleaseError, match=other.name):
        clef_local.load(variant)


def test_stale_temp_of_a_dead_run_is_removed(sources, tmp_path: Path, caplog) -> None:
    out = tmp_path / "v"
    stale = tmp_path / f".v.tmp-{2**22 + 12345}-deadbeef"  # a pid above pid_max's default: not running
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    with caplog.at_level("INFO"):
        quantize_release(sources["llama"], out, "fp8", validate=False)
    assert not stale.exists() and "stale" in caplog.text


@pytest.mark.parametrize("scheme", ["int4", "int4-compressed", "int8", "fp8"])
def test_row_blocks_quantize_bit_identically(scheme: str, monkeypatch) -> None:
    from clef_local.export import shards as export_quantize

    spec = quant.get(scheme.split("-")[0])
    options = {"layout": "compressed"} if scheme == "int4-compressed" else {}
    weight = torch.randn(100, 128).to(torch.bfloat16)
    whole = spec.quantize(weight, 64 if spec.name == "int4" else None, **options)
    # 12 rows' worth rounds down to blocks of 8 (8 zero points share a pack-quantized word), the last one of 4
    monkeypatch.setattr(export_quantize, "CHUNK_ELEMENTS", 128 * 12)
    blocks = export_quantize.quantize_tensor(spec, weight, 64 if spec.name == "int4" else None, **options)
    assert blocks.keys() == whole.keys()
    for key, value in whole.items():
        assert blocks[key].dtype == value.dtype and blocks[key].view(torch.uint8).equal(value.view(torch.uint8))


@pytest.mark.slow
def test_streaming_export_peak_rss_is_bounded_by_a_shard() -> None:
    """benchmarks/export_streaming.py: ~160 MB model in 9 shards; the int4 export's peak RSS is at most 4 shards and
    at most half the one-shard export's."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "export_streaming.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "ok: 9 shards" in proc.stdout or "ok: 8 shards" in proc.stdout


def test_a_source_already_on_a_4_bit_grid_gets_the_hint(sources, tmp_path: Path) -> None:
    """A dequantized GGUF Q4 model (the demo backbone) round-trips through int4 g32: the export says so."""
    from safetensors.torch import save_file

    from clef_local.export.quantize import already_4bit
    from clef_local.quant.predicate import should_quantize

    source = tmp_path / "q4-source"
    shutil.copytree(sources["llama"], source)
    for shard in source.glob("model*.safetensors"):
        state = load_file(shard)
        for name, tensor in state.items():
            if should_quantize(name, tuple(tensor.shape), 32)[0]:
                state[name] = quant.int4.dequantize(quant.int4.quantize(tensor, 32, grid="mlx"), 32)
        save_file(state, str(shard), metadata={"format": "pt"})
    on_grid = next(t for n, t in tensors(source).items() if should_quantize(n, tuple(t.shape), 32)[0])
    assert already_4bit(on_grid) and not already_4bit(torch.randn(64, 256).to(torch.bfloat16))
    assert not already_4bit(torch.zeros(8, 64)) and not already_4bit(torch.ones(8, 48))
    summary = quantize_release(source, tmp_path / "int8", "int8", validate=False)
    assert summary["source_4bit"] and any(line.startswith("note: ") and "--group-size 32" in line
                                          for line in summary_lines(summary))
    assert not quantize_release(source, tmp_path / "g32", "int4", 32, validate=False)["source_4bit"]
    assert not quantize_release(sources["llama"], tmp_path / "plain", "int8", validate=False)["source_4bit"]


def test_int4_follows_the_source_grid_when_no_group_size_is_given(sources, tmp_path: Path, capsys) -> None:
    """The demo backbone is a GGUF Q4_1 grid per 32 columns: the default int4 export uses g32 (before: g64, which
    failed its own validation after the whole export) and says so; --group-size still wins; a plain source keeps 64."""
    source = tmp_path / "q4-source"
    shutil.copytree(sources["llama"], source)
    for shard in source.glob("model*.safetensors"):
        state = load_file(shard)
        for name, tensor in state.items():
            if should_quantize(name, tuple(tensor.shape), 32)[0]:
                state[name] = quant.int4.dequantize(quant.int4.quantize(tensor, 32), 32).to(tensor.dtype)
        save_file(state, str(shard), metadata={"format": "pt"})
    out = tmp_path / "int4"
    assert main(["--model", str(source), "--bits", "4", "--out", str(out), "--no-validate"]) == 0
    printed = capsys.readouterr().out
    assert "int4 g32" in printed and "group size: 32, from the source" in printed and "note: " not in printed
    assert read_manifest(out)["scheme"]["group_size"] == 32
    assert read_release(out).quantization["clef_local"]["group_size"] == 32
    src, written = tensors(source), tensors(out)
    for name in read_manifest(out)["quantized"]:  # g32 gives the grid back (bf16 rounding aside)
        prefix = name.removesuffix(".weight")
        back = quant.int4.dequantize({k: written[f"{prefix}.{k}"] for k in ("weight", "scales", "biases")}, 32)
        assert (back.float() - src[name].float()).norm() <= 0.01 * src[name].float().norm(), name
    chosen = quantize_release(source, tmp_path / "g64", "int4", 64, validate=False)
    assert chosen["group_size"] == 64 and not chosen["group_from_source"] and chosen["source_4bit"]
    plain = quantize_release(sources["llama"], tmp_path / "plain-int4", "int4", validate=False)
    assert plain["group_size"] == 64 and not plain["group_from_source"]
