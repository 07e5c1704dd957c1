"""The Q8_0 kernel (backends/cpu_kernels/q8_dot.cpp) and Q8Linear on top of it: products
against float64 over every row tiling, the dense dequantization exact, rows read back
exactly, clear errors, and the AVX2 code in a process where torch dispatches to AVX2."""

from __future__ import annotations

import pytest
import torch

from backends.cpu_kernels.build import active_variant
from backends.quantized import q8_linear
from backends.quantized.q8_linear import DENSE_MIN_ROWS, Q8Linear
from tests.quantized.helpers import has_avx2, run_in_child

# Max error / largest output: int16 inputs per 32 columns measured ~6e-5 in float32 (with an
# outlier column setting a block's scale); bf16 inputs and outputs add two bf16 roundings.
TOLERANCE = {torch.float32: 5e-4, torch.bfloat16: 1.5e-2}


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4).half().float()
    return q, scale


def _dense(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.double().view(n, -1, 32) * scale.double().unsqueeze(-1)).view(n, k)


def check_products() -> str:
    """q8_mm against float64 over row counts, shapes and both input dtypes, a large outlier
    column included; a row alone gives the bits it gets among others."""
    assert q8_linear.available(torch.device("cpu"), torch.float32), active_variant()
    for seed, (n, k) in enumerate([(64, 256), (48, 576), (16, 32)]):
        q, scale = _weights(n, k, seed)
        packed, scales = q8_linear.pack(q), q8_linear.pack_scales(scale)
        weight = _dense(q, scale)
        for rows in (1, 3, 13, 19):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            x[:, k // 3] = 40.0
            for dtype, tol in TOLERANCE.items():
                got = torch.ops.switchyard_cpu.q8_mm(x.to(dtype), packed, scales)
                assert got.dtype == dtype and got.shape == (rows, n)
                want = x.to(dtype).double() @ weight.t()
                diff = (got.double() - want).abs().max().item()
                assert diff <= tol * want.abs().max().item(), (n, k, rows, dtype, diff)
            alone = torch.ops.switchyard_cpu.q8_mm(x[rows - 1:].contiguous(), packed, scales)
            assert torch.equal(alone[0], torch.ops.switchyard_cpu.q8_mm(x, packed, scales)[-1])
        for dtype in (torch.float32, torch.bfloat16):
            dense = torch.ops.switchyard_cpu.q8_dequantize(packed, scales, dtype)
            assert torch.equal(dense, weight.to(dtype)), (n, k, dtype)
    return active_variant() or ""


def needs_kernel() -> None:
    if not q8_linear.available(torch.device("cpu"), torch.float32):
        pytest.skip("the Q8_0 kernel runs where our kernels run (AVX2 or AVX-512 VNNI)")


def test_products_match_float64() -> None:
    needs_kernel()
    check_products()


def test_avx2_code_where_torch_dispatches_to_avx2() -> None:
    if not has_avx2():
        pytest.skip("this CPU has no AVX2")
    assert run_in_child("tests.quantized.test_q8_dot", "avx2").split() == ["avx2"]


def test_q8_linear_kernel_dense_path_and_rows() -> None:
    """Both paths of a float32 Q8Linear against float64, and rows() (a tied embedding's
    lookups) exactly the weight's rows."""
    needs_kernel()
    q, scale = _weights(96, 128, 5)
    bias = torch.randn(96)
    module = Q8Linear(q, scale, bias, torch.device("cpu"), torch.float32, shards=[32, 64])
    weight = _dense(q, scale)
    for rows in (2, DENSE_MIN_ROWS[torch.float32] + 4):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        want = x.double() @ weight.t() + bias.double()
        diff = (module(x).double() - want).abs().max().item()
        assert diff <= 5e-4 * want.abs().max().item(), (rows, diff)
    index = torch.tensor([95, 0, 17, 17, 64])
    assert torch.equal(module.rows(index), weight[index].float())
    assert torch.equal(module.dense(), weight.float())
    assert module.shards == [32, 64]


def test_many_rows_dequantize_a_slice_at_a_time() -> None:
    """q8_dense_mm (prefill's path) over a weight of several slices (16 MB of float32 each:
    32 lane blocks at 8192 columns, 65 here) against float64, in both dtypes."""
    needs_kernel()
    q, scale = _weights(1040, 8192, 7)
    packed, scales = q8_linear.pack(q), q8_linear.pack_scales(scale)
    weight = _dense(q, scale)
    x = torch.randn(DENSE_MIN_ROWS[torch.float32] + 6, 8192,
                    generator=torch.Generator().manual_seed(3))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1.5e-2)):
        got = torch.ops.switchyard_cpu.q8_dense_mm(x.to(dtype), packed, scales)
        want = x.to(dtype).double() @ weight.t()
        assert got.dtype == dtype and got.shape == (len(x), 1040)
        diff = (got.double() - want).abs().max().item()
        assert diff <= tol * want.abs().max().item(), (dtype, diff)


def test_a_malformed_call_raises_a_clear_error() -> None:
    needs_kernel()
    q, scale = _weights(16, 64, 2)
    packed, scales = q8_linear.pack(q), q8_linear.pack_scales(scale)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        torch.ops.switchyard_cpu.q8_mm(torch.randn(2, 32), packed, scales)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.switchyard_cpu.q8_mm(torch.randn(2, 64).half(), packed, scales)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.switchyard_cpu.q8_mm(torch.randn(2, 64), packed, scales.float())
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.switchyard_cpu.q8_mm(torch.randn(2, 64), packed.view(torch.uint8), scales)
    with pytest.raises(RuntimeError, match="q8_dense_mm: x has 32 columns, the weight 64"):
        torch.ops.switchyard_cpu.q8_dense_mm(torch.randn(70, 32), packed, scales)


if __name__ == "__main__":
    print(check_products())
