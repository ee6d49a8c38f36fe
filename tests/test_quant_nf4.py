"""nf4: pure-torch reference (packing, error bound), bit-exact against bitsandbytes, serialization and config."""

from __future__ import annotations

import json

import pytest
import torch

from clef_local.quant import nf4


def _weight(out_f: int = 32, in_f: int = 128, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return (torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)


def test_code_table_and_packing_high_nibble_first() -> None:
    code = nf4.code_table()
    assert code.shape == (16,) and code[0] == -1 and code[7] == 0 and code[15] == 1
    assert (code[1:] > code[:-1]).all()
    # One block of 64: value i*absmax-scaled code -> index known exactly (code values are their own nearest code).
    indices = torch.tensor([(5 * i + 3) % 16 for i in range(64)])
    indices[0] = 15  # absmax = 2.0 exactly
    w = (code[indices] * 2.0).reshape(1, 64)
    packed = nf4.quantize_reference(w)
    assert packed["weight"].dtype == torch.uint8 and packed["weight"].shape == (32, 1)
    expected = [(int(indices[2 * k]) << 4) | int(indices[2 * k + 1]) for k in range(32)]
    assert packed["weight"][:, 0].tolist() == expected
    assert packed["weight.absmax"].tolist() == [2.0]
    assert torch.equal(nf4.dequantize(packed), w)


def test_serialized_state_and_round_trip_bound() -> None:
    w = _weight(24, 96, seed=1)  # 2304 values: 36 blocks
    w[0, :64] = 0  # a zero block
    packed = nf4.quantize_reference(w)
    assert sorted(packed) == ["weight", "weight.absmax", "weight.quant_map", nf4.QUANT_STATE_KEY]
    assert packed["weight.absmax"].dtype == torch.float32 and packed["weight.absmax"].shape == (36,)
    blob = bytes(packed[nf4.QUANT_STATE_KEY].tolist()).decode()
    assert blob == '{"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [24, 96]}'
    deq = nf4.dequantize(packed)
    assert deq.dtype == torch.bfloat16 and deq.shape == (24, 96)
    code = nf4.code_table()
    half_gap = float(((code[1:] - code[:-1]) / 2).max())
    absmax = packed["weight.absmax"].repeat_interleave(64).reshape(24, 96)
    assert ((nf4.dequantize(packed, torch.float32) - w.float()).abs() <= half_gap * absmax * (1 + 1e-6)).all()
    assert torch.equal(deq[0, :64], torch.zeros(64, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((32, 128), torch.bfloat16), ((48, 256), torch.float32), ((7, 45), torch.float16), ((3, 64), torch.bfloat16)],
)
def test_reference_matches_bitsandbytes_bit_for_bit(shape: tuple[int, int], dtype: torch.dtype) -> None:
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    w = _weight(*shape, dtype=dtype, seed=sum(shape))
    data, state = quantize_4bit(w, blocksize=64, quant_type="nf4")
    ours = nf4.quantize_reference(w)
    theirs = {"weight": data, **{f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
    assert all(torch.equal(nf4.quantize(w)[k], v) for k, v in theirs.items())
    with torch._dynamo.config.patch(disable=True):  # bnb torch.compiles its ragged-tail dequantize (4 s)
        assert torch.equal(nf4.dequantize(ours), dequantize_4bit(data, state))


def test_double_quant_dequantize_matches_bitsandbytes() -> None:
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import QuantState, dequantize_4bit

    w = _weight(64, 512, seed=3)  # 512 blocks: two nested blocks of 256
    packed = nf4.quantize(w, double_quant=True)
    assert {"weight.nested_absmax", "weight.nested_quant_map"} <= set(packed)
    assert packed["weight.absmax"].dtype == torch.uint8
    # What transformers does on load: rebuild the QuantState from the saved tensors.
    state = QuantState.from_dict({k.removeprefix("weight."): v for k, v in packed.items() if k != "weight"}, "cpu")
    assert torch.equal(nf4.dequantize(packed), dequantize_4bit(packed["weight"], state))
    assert (nf4.dequantize(packed, torch.float32) - w.float()).abs().max() < 0.2 * w.float().abs().max()


def test_quantization_config_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    for double_quant, skip in [(False, None), (True, ["lm_head", "model.visual"])]:
        config = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=double_quant,
            llm_int8_skip_modules=skip,
        )
        expected = json.loads(json.dumps(config.to_dict(), default=str))
        assert nf4.quantization_config(skip, double_quant) == expected
    assert nf4.bits_per_weight(64) == 4.5


def test_quantize_without_bitsandbytes_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nf4, "bitsandbytes_available", lambda: False)
    w = _weight(8, 64)
    fallback, reference = nf4.quantize(w), nf4.quantize_reference(w)
    assert fallback.keys() == reference.keys() and all(torch.equal(fallback[k], reference[k]) for k in reference)
    with pytest.raises(RuntimeError, match="bitsandbytes"):
        nf4.quantize(w, double_quant=True)
