"""int4's grids in blocks on a thread pool write the bytes of the whole-tensor code they replaced
(tests/int4_reference.py, as of commit 3e3a44d), for every dtype, group and odd group; on a CUDA device, bytes close
to the CPU's."""

from __future__ import annotations

from collections.abc import Iterator

import int4_reference as reference
import pytest
import torch

from clef_local.quant import int4

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BITS_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The stored bit patterns (``torch.equal`` on floats takes -0.0 for 0.0)."""
    return t.view(BITS_VIEW[t.dtype]) if t.dtype in BITS_VIEW else t


def _weight(rows: int, cols: int, dtype: torch.dtype, group: int, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with outliers, then odd groups where there are rows for them: constant, zero, negative zero,
    tiny values that flush when a step is cast, values near the dtype's largest, already on a 4-bit grid (ties
    between candidates), on rounding midpoints, one-signed far from 0."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=generator) * 0.03
    w[torch.rand(rows, cols, generator=generator) < 0.01] *= 40
    info = torch.finfo(dtype)
    tiny = 1e-6 if dtype == torch.float16 else 1e-38
    codes = torch.randint(0, 16, (cols,), generator=generator).float()
    odd = [torch.full((group,), 0.5), torch.zeros(group), torch.full((group,), -0.0),
           torch.randn(group, generator=generator) * tiny, torch.randn(group, generator=generator) * info.max / 64,
           torch.linspace(-info.max / 4, info.max / 4, group), (codes[:group] - 5) / 8, (codes[:group] + 0.5) / 16,
           3.0 + torch.rand(group, generator=generator), -3.0 - torch.rand(group, generator=generator)]
    for i, values in enumerate(odd):
        if i < rows:
            column = (i * group) % cols
            w[i, column : column + group] = values
    if rows > len(odd):
        w[len(odd)] = (codes - 7) * 0.01 + 0.002  # a whole row on a 4-bit grid
    return w.to(dtype)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's intra-op threads for the test (the pool's size), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _assert_same_bytes(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for name, g, w in zip(("q", "scale", "bias / zero"), got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(_bits(g), _bits(w)), f"{name}: {int((_bits(g) != _bits(w)).sum())} values differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", int4.GROUP_SIZES)
@pytest.mark.parametrize("grid", int4.GRIDS)
def test_blocks_write_the_whole_tensor_codes_bytes(monkeypatch: pytest.MonkeyPatch, threads: int,
                                                   dtype: torch.dtype, group: int, grid: str) -> None:
    # blocks of 10 groups: boundaries inside rows, 37 rows × 512 columns end on a partial block
    monkeypatch.setattr(int4, "BLOCK_ELEMENTS", 10 * group)
    weight = _weight(37, 512, dtype, group)
    _assert_same_bytes(int4.quantize_values(weight, group, grid), reference.quantize_values(weight, group, grid))
    _assert_same_bytes(int4.zero_point_values(weight, group, grid), reference.zero_point_values(weight, group, grid))
    assert torch.get_num_threads() == threads  # the pool put torch's setting back


@pytest.mark.parametrize("shape", [(1, 64), (1, 4096), (3, 128), (0, 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_row_and_empty_weights(threads: int, shape: tuple[int, int], dtype: torch.dtype) -> None:
    weight = _weight(*shape, dtype, 32, seed=1)
    for grid in int4.GRIDS:
        _assert_same_bytes(int4.quantize_values(weight, 32, grid), reference.quantize_values(weight, 32, grid))
        _assert_same_bytes(int4.zero_point_values(weight, 32, grid), reference.zero_point_values(weight, 32, grid))


def test_default_blocks_on_a_weight_of_several(threads: int) -> None:
    # 2^19 values per block: 300 × 4096 bf16 is two blocks and a partial third
    weight = _weight(300, 4096, torch.bfloat16, 64, seed=2)
    assert weight.numel() > 2 * int4.BLOCK_ELEMENTS
    _assert_same_bytes(int4.quantize_values(weight, 64), reference.quantize_values(weight, 64))
    _assert_same_bytes(int4.zero_point_values(weight, 64), reference.zero_point_values(weight, 64))


def test_a_non_contiguous_weight() -> None:
    weight = _weight(256, 96, torch.bfloat16, 32, seed=3).T  # [96, 256], a transposed view
    _assert_same_bytes(int4.quantize_values(weight, 32), reference.quantize_values(weight, 32))
    _assert_same_bytes(int4.zero_point_values(weight, 32), reference.zero_point_values(weight, 32))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("group", int4.GROUP_SIZES)
def test_cuda_bytes_are_close_to_the_cpus(group: int) -> None:
    """On a GPU (one whole-tensor call) sums run in another order and a division by a number is a multiplication by
    its reciprocal: at most 1 code in 1,000 and 1 group in 100 may differ, and the squared error stays the CPU's
    within 0.1%."""
    weight = _weight(1024, 4096, torch.bfloat16, group, seed=4)
    w = weight.float()
    for grid in int4.GRIDS:
        for values, dequantize in ((int4.quantize_values, lambda q, s, b: q * s + b),
                                   (int4.zero_point_values, lambda q, s, z: (q - z) * s)):
            cpu = values(weight, group, grid)
            gpu = tuple(t.cpu() for t in values(weight.cuda(), group, grid))
            assert all(g.dtype == c.dtype and g.shape == c.shape for g, c in zip(gpu, cpu, strict=True))
            assert float((gpu[0] != cpu[0]).float().mean()) <= 1e-3, (values.__name__, grid)
            differ = (_bits(gpu[1]) != _bits(cpu[1])) | (_bits(gpu[2]) != _bits(cpu[2]))
            assert float(differ.float().mean()) <= 1e-2, (values.__name__, grid)
            errors = []
            for q, a, b in (cpu, gpu):
                q = q.float().reshape(*a.shape, group)
                back = dequantize(q, a.float()[..., None], b.float()[..., None]).reshape(w.shape)
                errors.append(float((back - w).square().sum()))
            assert errors[1] <= errors[0] * 1.001, (values.__name__, grid, errors)
