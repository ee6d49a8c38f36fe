"""Loading quantized variants on the torch backend (docs/format.md §6, §6): modules swapped before the weights load, the
kernel chosen once per layer, and decisions equal to those of the dequantized weights.

Tolerances (float32 unless said): a quantized module's output vs ``x @ scheme.dequantize(stored).T``: max error
≤ 1e-5 × max |reference| (bf16 activations: ≤ 2e-2); ``decide`` probabilities vs a normal model whose weights are
the dequantized variant's: max |Δp| ≤ 1e-4 (bf16: ≤ 2e-2); vs the unquantized source: max |Δp| ≤ 0.1 (loose: tiny
random models, 4-bit weights; measured ≤ 0.035).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from request_gen import varied_requests
from safetensors.torch import load_file, save_file
from torch import nn

import clef_local
from clef_local import quant
from clef_local.backends import quantized as ql
from clef_local.errors import ReleaseError
from clef_local.export.quantize import quantize_release
from clef_local.quant import nf4
from clef_local.quant.predicate import should_quantize

GROUP = {"int4": 32, "int8": None, "nf4": None, "fp8": None}  # tiny in_features (64, 128): int4 groups of 32
CPU_KERNEL = {"int4": "int4pack_cpu", "int8": "torch_int8pack_cpu", "nf4": "bnb_matmul_4bit",
              "fp8": "dequantize"}  # bf16 activations
# float32 activations: torch's int4/int8 CPU kernels are slower than dequantize-then-matmul, so they are not used
CPU_KERNEL_FP32 = {**CPU_KERNEL, "int4": "dequantize", "int8": "dequantize"}
PACKED_DTYPES = {torch.uint8, torch.uint32, torch.int8, torch.float8_e4m3fn}
REQUESTS = varied_requests(12, seed=3)[:9]  # the random mixes (the 255-option edge case exceeds llama's context)


def make_variant(source: Path, out: Path, scheme_name: str, group_size: int | None = None, *,
                 dequantized: bool = False) -> Path:
    """A variant of ``source`` written by the exporter; ``dequantized``: the same release with each selected
    weight replaced by its dequantized float32 value instead (the reference for kernel correctness)."""
    if not dequantized:
        quantize_release(source, out, scheme_name, group_size, validate=False, log_summary=False)
        return out
    scheme = quant.get(scheme_name)
    group = group_size or scheme.default_group_size
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("model*.safetensors*"))
    weight_map = {}
    for file in sorted(source.glob("model*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in load_file(file).items():
            if should_quantize(name, tuple(tensor.shape), scheme.predicate_group_size(group))[0]:
                tensors[name] = scheme.dequantize(scheme.quantize(tensor, group), group, torch.float32)
            else:
                tensors[name] = tensor
        save_file(tensors, out / file.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file.name))
    index = source / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        (out / index.name).write_text(json.dumps({**data, "weight_map": weight_map}, indent=2))
    return out


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, tiny_qwen: Path):
    """``variants(backbone, scheme, dequantized=False)`` -> a variant directory, built once per module."""
    root, cache = tmp_path_factory.mktemp("variants"), {}
    sources = {"llama": tiny_llama, "qwen3_5": tiny_qwen}

    def get(backbone: str, scheme: str, dequantized: bool = False) -> Path:
        key = (backbone, scheme, dequantized)
        if key not in cache:
            out = root / f"{backbone}-{scheme}{'-deq' if dequantized else ''}"
            cache[key] = make_variant(sources[backbone], out, scheme, GROUP[scheme], dequantized=dequantized)
        return cache[key]

    return get


def _stored(variant: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(variant.glob("model*.safetensors")):
        out.update(load_file(file))
    return out


def _quantized_names(source: Path, scheme: str) -> list[str]:
    group = quant.get(scheme).predicate_group_size(GROUP[scheme])
    return [n.removesuffix(".weight") for n, t in _stored(source).items()
            if should_quantize(n, tuple(t.shape), group)[0]]


def _probabilities(model: clef_local.ClefModel) -> list[np.ndarray]:
    return [p for prediction in model.predict(REQUESTS) for p in prediction.probabilities]


def _max_dp(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("scheme", list(GROUP))
@pytest.mark.parametrize("backbone", ["llama", "qwen3_5"])
def test_variant_modules_kernels_and_decisions(variants, tiny_llama, tiny_qwen, backbone, scheme):
    source = {"llama": tiny_llama, "qwen3_5": tiny_qwen}[backbone]
    variant = variants(backbone, scheme)
    expected = _quantized_names(source, scheme)
    model = clef_local.load(variant, dtype="float32")
    backbone_model = model.backend.backbone.model
    info = model.describe()
    assert info["scheme"] == scheme
    assert info["kernels"] == {f"{scheme}:{CPU_KERNEL_FP32[scheme]}": len(expected)}
    assert sorted(info["kernel_layers"]) == sorted(expected)
    for name in expected:  # the scheme's module holding packed tensors, no float weight of the layer's size
        module = backbone_model.get_submodule(name)
        assert type(module) is ql.MODULES[scheme] and module.kernel == CPU_KERNEL_FP32[scheme]
        tensors = dict(module.named_buffers())
        assert tensors["weight"].dtype in PACKED_DTYPES
        assert all(t.numel() < module.in_features * module.out_features or t.dtype in PACKED_DTYPES
                   for t in tensors.values())
    assert not any(type(m) is nn.Linear and n in expected for n, m in backbone_model.named_modules())

    ours = _probabilities(model)
    reference = _probabilities(clef_local.load(variants(backbone, scheme, dequantized=True), dtype="float32"))
    plain = _probabilities(clef_local.load(source, dtype="float32"))
    vs_reference, vs_source = _max_dp(ours, reference), _max_dp(ours, plain)
    print(f"{backbone} {scheme} float32: max |Δp| vs dequantized reference {vs_reference:.2e}, "
          f"vs unquantized source {vs_source:.2e}")
    assert vs_reference <= 1e-4
    assert vs_source <= 0.1


@pytest.mark.parametrize("scheme", list(GROUP))
@pytest.mark.parametrize("backbone", ["llama", "qwen3_5"])
def test_bfloat16_variant_decides_like_dequantized_reference(variants, backbone, scheme):
    model = clef_local.load(variants(backbone, scheme), dtype="bfloat16")
    assert model.describe()["kernels"] == {f"{scheme}:{CPU_KERNEL[scheme]}": len(model.backend.backbone.layers)}
    reference = clef_local.load(variants(backbone, scheme, dequantized=True), dtype="bfloat16")
    worst = _max_dp(_probabilities(model), _probabilities(reference))
    print(f"{backbone} {scheme} bfloat16: max |Δp| vs dequantized reference {worst:.2e}")
    assert worst <= 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", list(GROUP))
def test_module_forward_equals_dequantized_matmul(variants, scheme, dtype):
    variant = variants("qwen3_5", scheme)
    model = clef_local.load(variant, dtype=str(dtype).removeprefix("torch."))
    stored = _stored(variant)
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for name in model.backend.backbone.layers:
        module = model.backend.backbone.model.get_submodule(name)
        packed = {k.removeprefix(name + "."): v for k, v in stored.items() if k.startswith(name + ".")}
        weight = quant.get(scheme).dequantize(packed, GROUP[scheme], torch.float32)
        x = torch.randn(2, 7, module.in_features, generator=generator).to(dtype)
        with torch.inference_mode():
            y = module(x)
        assert y.dtype == dtype and y.shape == (2, 7, module.out_features)
        reference = x.float() @ weight.T
        worst = max(worst, float((y.float() - reference).abs().max() / reference.abs().max()))
    print(f"{scheme} {dtype}: module max error / max |x @ W.T| = {worst:.2e}")
    assert worst <= (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backbone", ["llama", "qwen3_5"])
def test_unquantized_tensors_and_rotary_buffers_equal_a_normal_load(variants, tiny_llama, tiny_qwen, backbone,
                                                                    dtype):
    import transformers

    source = {"llama": tiny_llama, "qwen3_5": tiny_qwen}[backbone]
    cls = transformers.Qwen3_5ForConditionalGeneration if backbone == "qwen3_5" else transformers.AutoModelForCausalLM
    normal = cls.from_pretrained(source, dtype=dtype)
    ours = clef_local.load(variants(backbone, "int8"), dtype=str(dtype).removeprefix("torch.")).backend.backbone.model
    quantized = set(_quantized_names(source, "int8"))
    normal_tensors = {**normal.state_dict(), **dict(normal.named_buffers())}
    our_tensors = {**ours.state_dict(), **dict(ours.named_buffers())}
    rotary = [n for n in normal_tensors if "inv_freq" in n]
    assert rotary and all(n in our_tensors for n in rotary)
    for name, tensor in normal_tensors.items():
        if name.rsplit(".", 1)[0] not in quantized:
            assert our_tensors[name].dtype == tensor.dtype and torch.equal(our_tensors[name], tensor), name
    if backbone == "llama":  # tied embeddings are tied again
        assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight


def test_loading_never_dequantizes_and_holds_packed_bytes(variants, tiny_llama, monkeypatch):
    """The two-phase load assigns the stored tensors: no dequantize runs, the layers hold ~bits/8 bytes a weight."""

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was dequantized during load")

    for module in (quant.int4, quant.int8, quant.fp8, quant.nf4):
        monkeypatch.setattr(module, "dequantize", refuse)
    for scheme, bound in {"int4": 0.4, "nf4": 0.4, "int8": 0.6, "fp8": 0.6}.items():
        model = clef_local.load(variants("llama", scheme), dtype="bfloat16").backend.backbone.model
        for name in _quantized_names(tiny_llama, scheme):
            module = model.get_submodule(name)
            assert isinstance(module, ql.MODULES[scheme])
            held = sum(t.numel() * t.element_size() for t in module.buffers())
            assert held <= bound * 2 * module.in_features * module.out_features, (scheme, name, held)


def test_int4_on_a_cpu_takes_torchs_layout_where_it_can_without_a_warning(caplog):
    """bf16 activations on a CPU: a layer torch's int4 kernel can hold (out % 16 == 0) runs ``int4pack_cpu``, one
    it cannot dequantizes, with the reason logged at INFO (not a warning); both with the right numbers."""
    model = nn.Sequential(nn.Linear(64, 24, bias=True), nn.Linear(64, 32, bias=False))
    weights = {str(i): layer.weight.detach().clone() for i, layer in enumerate(model)}
    state = {f"{i}.{k}": v for i, w in weights.items() for k, v in quant.int4.quantize(w, 32).items()}
    state["0.bias"] = model[0].bias.detach().clone()
    headers = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 24, bias=True), nn.Linear(64, 32, bias=False))
    ql.swap_linears(model, ql.quantized_prefixes(headers, "int4"), headers, dtype=torch.bfloat16)
    model.load_state_dict(state, strict=True, assign=True)
    with caplog.at_level(logging.INFO, logger="clef_local.backends.quantized"):
        layers = ql.prepare_quantized(model)
    assert layers == {"0": "int4:dequantize", "1": "int4:int4pack_cpu"}
    assert "out_features 24 is not a multiple of 16" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    x = torch.randn(3, 64).to(torch.bfloat16).float()
    for i, layer in enumerate(model):
        packed = {k.removeprefix(f"{i}."): v for k, v in state.items() if k.startswith(f"{i}.") and k != "0.bias"}
        reference = x @ quant.int4.dequantize(packed, 32, torch.float32).T + (state["0.bias"] if i == 0 else 0)
        torch.testing.assert_close(layer(x.to(torch.bfloat16)).float(), reference, rtol=2e-2, atol=2e-2)


def test_int8_takes_its_kernel_for_short_calls_and_dequantizes_prefills(monkeypatch):
    stored = quant.int8.quantize(torch.randn(128, 64, generator=torch.Generator().manual_seed(7)))
    headers = {f"0.{k}": (tuple(v.shape), v.dtype) for k, v in stored.items()}
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 128, bias=False))
    ql.swap_linears(model, ql.quantized_prefixes(headers, "int8"), headers, dtype=torch.bfloat16)
    model.load_state_dict({f"0.{k}": v for k, v in stored.items()}, assign=True)
    assert ql.prepare_quantized(model) == {"0": "int8:torch_int8pack_cpu"}
    calls: list[int] = []
    kernel = quant.int8.int8_matmul
    monkeypatch.setattr(quant.int8, "int8_matmul", lambda x, packed: calls.append(x.numel() // 64) or kernel(x, packed))
    for shape in ((1, 15, 64), (3, 5, 64), (1, 16, 64), (4, 300, 64)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(8))
        reference = x @ quant.int8.dequantize(stored).T
        y = model[0](x.to(torch.bfloat16)).float()
        assert float((y - reference).abs().max() / reference.abs().max()) <= 2e-2, shape
    assert calls == [15, 15] and ql.INT8_KERNEL_ROWS == 16  # 16 rows and more: the blocked conversion


def test_int8_kernel_gets_an_aligned_weight():
    """A weight read from a shard may sit 8 bytes past a 64-byte boundary; torch's int8 kernel segfaults on it with
    bf16 activations, so the layer copies it to an aligned address when it picks that kernel."""
    stored = quant.int8.quantize(torch.randn(128, 64, generator=torch.Generator().manual_seed(5)))
    buffer = torch.empty(128 * 64 + 64, dtype=torch.int8)
    offset = (8 - buffer.data_ptr()) % 64  # data_ptr % 64 == 8, as a safetensors data offset can be
    unaligned = buffer[offset:offset + 128 * 64].view(128, 64)
    unaligned.copy_(stored["weight"])
    assert unaligned.data_ptr() % 64 == 8
    headers = {f"0.{k}": (tuple(v.shape), v.dtype) for k, v in stored.items()}
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 128, bias=False))
    ql.swap_linears(model, ql.quantized_prefixes(headers, "int8"), headers, dtype=torch.bfloat16)
    model.load_state_dict({"0.weight": unaligned, "0.weight_scale": stored["weight_scale"]}, assign=True)
    assert ql.prepare_quantized(model) == {"0": "int8:torch_int8pack_cpu"}
    assert model[0].weight.data_ptr() % 64 == 0 and torch.equal(model[0].weight, stored["weight"])
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(6))
    reference = x @ quant.int8.dequantize(stored).T
    y = model[0](x.to(torch.bfloat16)).float()
    assert float((y - reference).abs().max() / reference.abs().max()) <= 2e-2


def test_repack_by_row_blocks_is_bit_identical():
    packed = quant.int4.quantize(torch.randn(1040, 256, generator=torch.Generator().manual_seed(1)), 64)
    from clef_local.quant import int4_cpu

    layout = int4_cpu.cpu_layout()

    def convert(block: dict[str, torch.Tensor], group: int, dtype: torch.dtype) -> quant.int4.TorchInt4:
        return int4_cpu.repack(block, group, dtype, layout)  # what Int4Linear.prepare hands repack_int4

    for dtype in (torch.float32, torch.bfloat16):
        whole = convert(packed, 64, dtype)
        blocks = ql.repack_int4(packed, 64, dtype, rows=64 * 256, convert=convert)  # 64-row blocks + a 16-row rest
        assert torch.equal(whole.weight, blocks.weight) and torch.equal(whole.scales_and_zeros, blocks.scales_and_zeros)


def test_cuda_kernel_paths_checked_on_cpu():
    """The CUDA paths (fp8 row-wise ``torch._scaled_mm``, bitsandbytes int8, ``torch._int_mm`` int8) forced onto
    torch's / bitsandbytes' CPU implementations: within the activation-quantization error of dequantize-then-matmul
    (e4m3 activations: 2^-4 relative per element, bound 5e-2 of max |y|; int8 activations: 1/254, bound 3e-2)."""
    pytest.importorskip("bitsandbytes")
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(3))
    for scheme, switch, bound in (("fp8", lambda m: m.use_scaled_mm(torch.float32), 5e-2),
                                  ("int8", lambda m: m.use_bnb_int8(), 3e-2),
                                  ("int8", lambda m: m.use_int_mm(), 3e-2)):
        stored = quant.get(scheme).quantize(weight)
        headers = {f"0.{k}": (tuple(v.shape), v.dtype) for k, v in stored.items()}
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(128, 64, bias=False))
        ql.swap_linears(model, ql.quantized_prefixes(headers, scheme), headers, dtype=torch.float32)
        model.load_state_dict({f"0.{k}": v for k, v in stored.items()}, strict=True, assign=True)
        switch(model[0])
        reference = x @ quant.get(scheme).dequantize(stored).T
        y = model[0](x)
        assert y.dtype == torch.float32 and y.shape == reference.shape
        assert float((y - reference).abs().max() / reference.abs().max()) <= bound, scheme


def test_sharded_variant_loads_shard_by_shard(tmp_path, variants):
    from clef_local.testing import build_tiny_release

    source = build_tiny_release(tmp_path / "sharded", backbone="llama", seed=1, shards=3)
    variant = make_variant(source, tmp_path / "sharded-int8", "int8")
    assert len(list(variant.glob("model-*.safetensors"))) == 3
    sharded = _probabilities(clef_local.load(variant, dtype="float32"))
    single = _probabilities(clef_local.load(variants("llama", "int8"), dtype="float32"))
    assert _max_dp(sharded, single) <= 1e-6


def test_nf4_without_bitsandbytes_names_the_install(variants, monkeypatch):
    monkeypatch.setattr(quant.nf4, "bitsandbytes_available", lambda: False)
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        clef_local.load(variants("llama", "nf4"), dtype="float32")


def test_mismatched_scheme_and_tensors_are_named(variants, tmp_path):
    variant = shutil.copytree(variants("llama", "int4"), tmp_path / "mislabelled")
    config = json.loads((variant / "config.json").read_text())
    config["quantization_config"]["clef_local"]["scheme"] = "int8"
    (variant / "config.json").write_text(json.dumps(config))
    with pytest.raises(ReleaseError, match=r"config\.json.*clef_local_manifest\.json"):
        clef_local.load(variant)  # the manifest catches the edit first
    (variant / "clef_local_manifest.json").unlink()  # a hand-made variant without a manifest
    with pytest.raises(ReleaseError, match=r"model\.layers\.0\..*scales.* not a int8 layer"):
        clef_local.load(variant)


def test_plain_release_reports_no_kernels(tiny_llama):
    info = clef_local.load(tiny_llama, dtype="float32").describe()
    assert info["quantization"] is None and "kernels" not in info


def test_transformers_reloads_the_nf4_variant(variants, tiny_llama):
    """transformers' own bitsandbytes support reads the nf4 variant (``Linear4bit`` layers, same 4-bit weights).
    Its logits match ours within 2e-2 × max |logit|: it computes in ``bnb_4bit_compute_dtype`` = bfloat16."""
    bnb = pytest.importorskip("bitsandbytes")
    import transformers

    variant = variants("llama", "nf4")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(variant, dtype=torch.float32)
    layers = {n: m for n, m in theirs.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert sorted(layers) == sorted(_quantized_names(tiny_llama, "nf4"))
    stored = _stored(variant)
    for name, module in layers.items():
        module.support_avx512bf16_for_cpu = False  # docs/hardware.md, known traps: no in-place CPU repack
        packed = {k.removeprefix(name + "."): v for k, v in stored.items() if k.startswith(name + ".")}
        deq = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
        assert torch.equal(deq, nf4.dequantize(packed))  # both in the stored dtype (bfloat16)
    ours = clef_local.load(variant, dtype="float32").backend.backbone.model
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        theirs_logits, our_logits = theirs(ids).logits.float(), ours(ids).logits
    error = float((theirs_logits - our_logits).abs().max() / our_logits.abs().max())
    print(f"transformers nf4 reload vs clef-local nf4 (float32): max |Δlogit| / max |logit| = {error:.2e}")
    assert error <= 2e-2


_RSS_CHILD = """
import gc, json, sys
from pathlib import Path
import torch
from clef_local.backends.torch_backend import TorchBackbone
def status(key):
    return next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
                if l.startswith(key + ":"))
def load(path):
    return TorchBackbone(path, json.loads((path / "config.json").read_text()), dtype=torch.bfloat16)
load(Path(sys.argv[2]))  # warm-up on a tiny release of the same kind (lazy imports)
gc.collect()
Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
base, anon = status("VmRSS"), status("RssAnon")
model = load(Path(sys.argv[1]))
print(json.dumps({"peak": status("VmHWM") - base, "anon": status("RssAnon") - anon}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_int4_load_peak_memory_stays_below_the_bf16_size(tmp_path):
    """A 38 M-parameter llama (75 MB in bf16): loading its int4 variant raises the peak RSS by well under the bf16
    size (file pages of the mapped shard included); the anonymous memory is ~ the packed weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(path: Path, hidden: int, layers: int) -> Path:
        """A tiny llama release (tokenizer, head files) whose backbone is replaced by a bigger one."""
        from clef_local.heads.torch_head import HeadConfig, JointSchemaHead
        from clef_local.testing import build_tiny_release

        build_tiny_release(path, backbone="llama", seed=0)
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=520, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                             num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
        head = HeadConfig(hidden_size=hidden, width=32, routing_layers=1, layers=1, heads=4, feedforward=64)
        save_file(JointSchemaHead(head).state_dict(), path / "joint_head.safetensors")
        (path / "joint_head_config.json").write_text(json.dumps(
            {k: v for k, v in head.to_json_dict().items() if k != "dropout"}))
        return make_variant(path, path.with_name(path.name + "-int4"), "int4", 64)

    variant, tiny = build(tmp_path / "big", 768, 4), build(tmp_path / "tiny", 64, 1)
    bf16_bytes = (tmp_path / "big" / "model.safetensors").stat().st_size
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(variant), str(tiny)], capture_output=True, text=True,
                         check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"int4 load: peak RSS +{result['peak'] / 2**20:.0f} MiB, anonymous +{result['anon'] / 2**20:.0f} MiB "
          f"for {bf16_bytes / 2**20:.0f} MiB of bf16 weights")
    assert result["peak"] <= 0.8 * bf16_bytes
    assert result["anon"] <= 0.5 * bf16_bytes


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings (Linux)")
def test_the_stored_codes_do_not_keep_the_shard_mapped(tmp_path: Path) -> None:
    """read_shard maps the unquantized tensors and reads the quantized linears' own: once the mapped ones are gone,
    the file is no longer mapped however long the codes live (a kernel that repacks them frees the stored copy)."""
    import gc

    from clef_local.backends.skeleton import read_shard

    file = tmp_path / "model.safetensors"
    stored = {"model.layers.0.mlp.up_proj.weight": torch.randint(0, 255, (64, 32), dtype=torch.uint8),
              "model.layers.0.mlp.up_proj.scales": torch.rand(64, 1), "model.norm.weight": torch.rand(32)}
    save_file(stored, file)
    state = read_shard(file, ("model.layers.0.mlp.up_proj.",))
    assert set(state) == set(stored) and all(torch.equal(state[k], stored[k]) for k in stored)
    assert str(file) in Path("/proc/self/maps").read_text()  # the norm is mapped
    codes = {k: v for k, v in state.items() if k.startswith("model.layers.0.mlp.up_proj.")}
    del state
    gc.collect()
    assert str(file) not in Path("/proc/self/maps").read_text()
    assert torch.equal(codes["model.layers.0.mlp.up_proj.weight"], stored["model.layers.0.mlp.up_proj.weight"])
