"""int4 (MLX affine layout): golden MLX output, packing bit for bit, error bound, torch int4 kernel repack."""

from __future__ import annotations

import pytest
import torch

from clef_local.quant import int4, int4_cpu

# mx.quantize(bf16 w, group_size=32, bits=4) on mlx 0.32.4 (CPU) for the tensor built by _golden_weight().
GOLDEN_WORDS = [
    [0x159D26BF, 0xD26AE37C, 0xAE37B048, 0x6BF48C15, 0x37C159D2, 0x048D26AE, 0xC15AE37B, 0x9D26BF48],
    [0x679ABCEF, 0xCEF01245, 0x245679AB, 0x9ABCEF01, 0xF0124567, 0x5679ABCE, 0xBCEF0124, 0x1245679A],
    [0xE37C16AF, 0x8D27B059, 0x37C16AF4, 0xD27B059E, 0x7C16AF48, 0x27B059E3, 0xC16AF48D, 0x7B059E37],
    [0, 0, 0, 0, 0, 0, 0, 0],
]
GOLDEN_SCALES = [-0.1181640625, -0.1015625, 0.033447265625, -1.0011717677116394e-07]  # same for both groups
GOLDEN_BIASES = [1.0625, 1.625, -0.5, 0.0]


def _golden_weight() -> torch.Tensor:
    rows = [
        [((i * 37) % 29 - 11) / 16 for i in range(64)],  # both signs, |max| > |min|: negative scale
        [(i % 13 + 1) / 8 for i in range(64)],  # all positive
        [-((i * 5) % 17) / 32 for i in range(64)],  # all <= 0: positive scale
        [0.0] * 64,  # zero group: scale -eps, bias 0
    ]
    return torch.tensor(rows, dtype=torch.float32).to(torch.bfloat16)


def _weight(out_f: int, in_f: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(out_f, in_f, generator=generator) * 0.03).to(dtype)


def test_matches_mlx_golden_bit_for_bit() -> None:
    packed = int4.quantize(_golden_weight(), group_size=32, grid="mlx")
    assert packed["weight"].dtype == torch.uint32 and packed["weight"].shape == (4, 8)
    assert packed["scales"].dtype == torch.bfloat16 and packed["scales"].shape == (4, 2)
    words = packed["weight"].to(torch.int64).tolist()
    assert words == GOLDEN_WORDS
    assert packed["scales"].float().tolist() == [[s, s] for s in GOLDEN_SCALES]
    assert packed["biases"].float().tolist() == [[b, b] for b in GOLDEN_BIASES]
    assert torch.equal(int4.dequantize(packed, 32)[3], torch.zeros(64, dtype=torch.bfloat16))


def test_pack_layout_little_endian_nibbles() -> None:
    q = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 15, 0, 0, 0, 0, 0, 0, 9]], dtype=torch.uint8)
    words = int4.pack(q)
    assert words.dtype == torch.uint32 and words.shape == (1, 2)
    assert words.to(torch.int64).tolist() == [[0x76543210, 0x9000000F]]
    generator = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (5, 64), generator=generator, dtype=torch.uint8)
    words = int4.pack(q).to(torch.int64)
    for j in range(8):  # column 8k+j sits at bits 4j..4j+3 of word k
        assert torch.equal((words >> (4 * j)) & 0xF, q[:, j::8].to(torch.int64))
    assert torch.equal(int4.unpack(int4.pack(q)), q)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_bound_of_the_mlx_grid(group_size: int, dtype: torch.dtype) -> None:
    w = _weight(48, 256, dtype, seed=group_size)
    w[0] = w[0].abs() + 0.01  # one-signed rows too
    w[1] = -w[1].abs()
    packed = int4.quantize(w, group_size, grid="mlx")
    assert packed["scales"].shape == (48, 256 // group_size) and packed["scales"].dtype == dtype
    deq = int4.dequantize(packed, group_size, torch.float32)
    q, _, _ = int4.quantize_values(w, group_size, grid="mlx")
    assert int(q.max()) <= 15
    scale = packed["scales"].float().abs().repeat_interleave(group_size, dim=1)
    bias = packed["biases"].float().abs().repeat_interleave(group_size, dim=1)
    slack = 0.0 if dtype == torch.float32 else 2**-8 * (bias + 15 * scale)  # bf16 rounding of scale and bias
    err = (deq - w.float()).abs()
    assert (err <= scale * (1 + 1e-5) + slack + 1e-7).all()  # documented bound: |scale| (clamped far extreme)
    assert (err <= scale / 2 * (1 + 1e-5) + slack + 1e-7).float().mean() > 0.97  # |scale|/2 inside the grid


def _group_sse(w: torch.Tensor, deq: torch.Tensor, group_size: int) -> torch.Tensor:
    return (deq.float() - w.float()).square().reshape(w.shape[0], -1, group_size).sum(-1)


def _minmax_round_trip(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """The min-max grid (step = range / 15) stored as documented: bias at the edge of larger magnitude, scale
    and bias in w's dtype, codes assigned with the stored values. Written out independently of the module."""
    x = w.float().reshape(w.shape[0], -1, group_size)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    step = ((hi - lo) / 15).clamp(min=1e-7)
    flip = lo.abs() < hi.abs()
    scale = torch.where(flip, -step, step).to(w.dtype).float()
    bias = torch.where(flip, hi, lo).to(w.dtype).float()
    return (((x - bias) / scale).round().clamp(0, 15) * scale + bias).reshape(w.shape)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mse_grid_is_never_worse_than_mlx_or_min_max(group_size: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(group_size)
    uniform = torch.rand(16, 256, generator=generator) - 0.5
    laplace = -0.02 * uniform.sign() * torch.log1p(-2 * uniform.abs())  # Laplace(0, 0.02) by its inverse CDF
    w = torch.cat([_weight(32, 256, dtype, seed=group_size), laplace.to(dtype)])  # Gaussian and heavy-tailed rows
    w[0] = w[0].abs() + 0.01
    w[1] = -w[1].abs()
    w[2, :group_size] = 0
    w[3, :group_size] = torch.randn(group_size, generator=generator).to(dtype)  # one group at another scale
    ours = _group_sse(w, int4.dequantize(int4.quantize(w, group_size), group_size, torch.float32), group_size)
    mlx = _group_sse(w, int4.dequantize(int4.quantize(w, group_size, grid="mlx"), group_size, torch.float32),
                     group_size)
    minmax = _group_sse(w, _minmax_round_trip(w, group_size), group_size)
    assert (ours <= mlx).all() and (ours <= minmax * (1 + 1e-6) + 1e-12).all()
    assert ours[2, 0] == 0  # the zero group stays exactly zero
    # On Gaussian and Laplace weights the least-squares grids take a real share of the error off.
    assert ours[4:].sum() < 0.9 * mlx[4:].sum()  # measured: 0.74 (g32) to 0.87 (g128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mse_grid_recovers_weights_that_are_already_4_bit(dtype: torch.dtype) -> None:
    """A GGUF Q4_1 model dequantized to BF16 (the demo backbone) holds 16 levels per block of 32: the mse grid at
    g = 32 gives them back up to the dtype's rounding of scale and bias; MLX's zero-exact grid does not."""
    generator = torch.Generator().manual_seed(3)
    levels = torch.randint(0, 16, (64, 256), generator=generator)
    levels[:, ::32], levels[:, 1::32] = 0, 15  # every block spans its whole grid, as Q4_1 blocks do
    step = torch.rand(64, 8, 1, generator=generator) * 0.01 + 0.001
    lo = -step * (torch.rand(64, 8, 1, generator=generator) * 10 + 2)
    w = (levels.reshape(64, 8, 32) * step + lo).reshape(64, 256).to(dtype)
    ours = int4.dequantize(int4.quantize(w, 32), 32, torch.float32)
    mlx = int4.dequantize(int4.quantize(w, 32, grid="mlx"), 32, torch.float32)
    rel = lambda r: float((r - w.float()).norm() / w.float().norm())  # noqa: E731
    assert rel(ours) <= (1e-6 if dtype == torch.float32 else 4e-3)
    assert rel(mlx) > 0.03


def test_unknown_grid_is_refused() -> None:
    with pytest.raises(ValueError, match="grid"):
        int4.quantize(_weight(16, 64), 32, grid="gptq")


def test_matches_mlx_when_installed() -> None:
    mx = pytest.importorskip("mlx.core")
    import numpy as np

    for dtype, mx_dtype in [(torch.float32, mx.float32), (torch.bfloat16, mx.bfloat16)]:
        for group_size in (32, 64, 128):
            w = _weight(32, 256, dtype, seed=7)
            w[2] = w[2].abs() + 0.02
            w[3, :group_size] = 0
            ours = int4.quantize(w, group_size, grid="mlx")
            q, s, b = mx.quantize(mx.array(w.float().numpy()).astype(mx_dtype), group_size=group_size, bits=4)
            assert np.array_equal(ours["weight"].view(torch.int32).numpy(), np.array(q).view(np.int32))
            assert np.array_equal(ours["scales"].float().numpy(), np.array(s.astype(mx.float32)))
            assert np.array_equal(ours["biases"].float().numpy(), np.array(b.astype(mx.float32)))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_torch_int4pack_float32_matches_dequantize(group_size: int) -> None:
    packed = int4.quantize(_weight(96, 512, seed=3), group_size)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(4))
    ref = x @ int4.dequantize(packed, group_size, torch.float32).T
    repacked = int4_cpu.repack(packed, group_size, torch.float32, int4_cpu.cpu_layout())
    assert repacked.weight.dtype == torch.uint8 and repacked.scales_and_zeros.shape == (512 // group_size, 96, 2)
    y = int4_cpu.matmul(x, repacked, kernel_rows=6)  # torch's packed kernel, not the blocked dequantize
    assert y.dtype == torch.float32
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    y3 = int4_cpu.matmul(x.reshape(5, 1, 512), repacked, kernel_rows=6)  # leading dims kept
    assert y3.shape == (5, 1, 96) and torch.equal(y3.reshape(5, 96), y)


def test_torch_int4pack_bfloat16_is_exact_up_to_output_rounding() -> None:
    # Real weight groups hold both signs: z = bias + 8*scale is exact in bf16 (module docstring), so the bf16 kernel
    # returns x @ W.T rounded to bf16 (within 1 bf16 ulp: accumulation order may differ).
    group_size = 64
    packed = int4.quantize(_weight(64, 512, seed=5), group_size)
    zeros = packed["biases"].float() + 8 * packed["scales"].float()
    assert torch.equal(zeros.to(torch.bfloat16).float(), zeros)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    ref = x.float() @ int4.dequantize(packed, group_size, torch.float32).T
    y = int4_cpu.matmul(x, int4_cpu.repack(packed, group_size, torch.bfloat16, int4_cpu.cpu_layout()), kernel_rows=8)
    assert y.dtype == torch.bfloat16
    assert ((y.float() - ref).abs() <= 2**-8 * ref.abs() + 1e-6).all()
    assert (y == ref.to(torch.bfloat16)).float().mean() >= 0.95


def test_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="group_size"):
        int4.quantize(_weight(16, 64), group_size=16)
    with pytest.raises(ValueError, match="multiple"):
        int4.quantize(_weight(16, 96), group_size=64)
    assert "not a multiple of 16" in int4_cpu.unsupported(8, 64, 64)  # torch's CPU kernel: out_features % 16
    assert int4.bits_per_weight(64) == 4.5 and int4.bits_per_weight(32) == 5.0


def test_tinygemm_uint8_puts_the_even_column_in_the_high_nibble() -> None:
    """The CUDA kernel's input layout (checked on CPU; the kernel itself in tests/test_cuda_quant.py)."""
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 0, 15]])
    assert int4.tinygemm_uint8(q).tolist() == [[0x12, 0xF0], [0x78, 0x0F]]
    stored = int4.quantize(_weight(16, 64), 32)
    nibbles = int4.tinygemm_uint8(int4.unpack(stored["weight"]))
    assert torch.equal(torch.stack([nibbles >> 4, nibbles & 0xF], -1).reshape(16, 64), int4.unpack(stored["weight"]))


def test_tinygemm_scales_and_zeros_are_the_cpu_kernels() -> None:
    """Both torch kernels compute (q - 8)·s + z: the same pairs serve both, and they reproduce dequantize."""
    stored = int4.quantize(_weight(16, 128), 64)
    pairs = int4.scales_and_zeros(stored, torch.float32)
    assert torch.equal(pairs, int4_cpu.repack(stored, 64, torch.float32, int4_cpu.cpu_layout()).scales_and_zeros)
    q = int4.unpack(stored["weight"]).float().reshape(16, 2, 64)
    rebuilt = (q - 8) * pairs[:, :, 0].T[..., None] + pairs[:, :, 1].T[..., None]
    torch.testing.assert_close(rebuilt.reshape(16, 128), int4.dequantize(stored, 64, torch.float32))


@pytest.mark.parametrize(("in_features", "tiles"), [(4096, 8), (576, 4), (96, 2), (1536, 8), (40, None)])
def test_tinygemm_inner_k_tiles(in_features: int, tiles: int | None) -> None:
    assert int4.tinygemm_inner_k_tiles(in_features) == tiles


def test_tinygemm_says_why_it_does_not_apply() -> None:
    assert "CUDA" in int4.tinygemm_unsupported(torch.device("cpu"), torch.bfloat16, 64, 64, 64)


@pytest.mark.slow
def test_the_demo_backbone_is_already_4_bit_and_g32_gives_it_back(demo_release) -> None:
    """The demo backbone was dequantized from GGUF Q4_1: its linear weights hold <= 16 values per 32 columns, the
    mse grid at g32 returns them up to bf16 rounding, MLX's zero-exact grid does not (README, Quantized variants)."""
    from safetensors import safe_open

    from clef_local.export.quantize import already_4bit

    with safe_open(str(demo_release / "model.safetensors"), framework="pt") as f:
        names = [n for n in f.keys() if n.endswith(("q_proj.weight", "down_proj.weight"))][:4]  # noqa: SIM118
        for name in names:
            w = f.get_tensor(name)
            groups = w.reshape(w.shape[0], -1, 32)[:64]
            assert max(len(torch.unique(g)) for row in groups for g in row) <= 16, name
            mse, mlx = (float((int4.dequantize(int4.quantize(w, 32, grid), 32, torch.float32) - w.float()).norm()
                              / w.float().norm()) for grid in ("mse", "mlx"))
            assert mse < 0.006 and mlx > 0.05, name
            assert already_4bit(w)
