"""Prefill's products of packed weights (dense_slices.h: the weight dequantized a 16 MB slice
at a time, each slice multiplied by oneDNN) over weights of several slices, against the same
weights dequantized whole by each format's own operator: a slice put at the wrong columns, or
one dequantized from the wrong offset, changes the product."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from backends.cpu_kernels.build import active_variant
from backends.quantized.int4_linear import Int4Linear
from backends.quantized.kquant_linear import KQuantLinear
from tests.quantized.gguf_files import blocks
from tests.quantized.int4_layout_check import random_weight

CPU = torch.device("cpu")
# float32 products of the same weights summed in another order; bf16 rounds the output once
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _inputs(rows: int, k: int) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))


def _check(got: torch.Tensor, x: torch.Tensor, weight_nk: torch.Tensor,
           dtype: torch.dtype) -> None:
    want = x.to(dtype).double() @ weight_nk.double().t()
    assert got.dtype == dtype and got.shape == want.shape
    diff = (got.double() - want).abs().max().item()
    assert diff <= TOLERANCE[dtype] * want.abs().max().item(), (dtype, diff)


@pytest.fixture(autouse=True)
def needs_kernels() -> None:
    if active_variant() is None:
        pytest.skip("our kernels are not built on this machine")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_product_over_several_slices(dtype: torch.dtype) -> None:
    """65 lane blocks of 8192 columns: 32 a slice in float32, 64 in bfloat16."""
    module = Int4Linear(random_weight(1040, 8192, 32, 3, False), None, CPU, dtype)
    assert module.kernel == "cpu-int8-dot"
    x = _inputs(130, 8192)
    got = torch.ops.switchyard_cpu.q4_dense_mm(x.to(dtype), module.packed, module.scale_zeros,
                                               module.group_size)
    weight = torch.ops.switchyard_cpu.q4_dequantize_kn(module.packed, module.scale_zeros,
                                                       module.group_size, torch.float32).t()
    _check(got, x, weight, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kquant_product_over_several_slices(dtype: torch.dtype) -> None:
    """Q6_K rows of 4096 columns: 1024 a slice in float32, 2048 in bfloat16; 2100 rows."""
    n, k, qtype = 2100, 4096, GGMLQuantizationType.Q6_K
    values = np.random.default_rng(5).normal(0, 0.1, (n, k)).astype(np.float32)
    data = torch.from_numpy(blocks(values, qtype, np.random.default_rng(6)))
    module = KQuantLinear(data, qtype, k, None, CPU, dtype)
    x = _inputs(70, k)
    got = torch.ops.switchyard_cpu.kquant_dense_mm(x.to(dtype), module.packed, module.qtype, k)
    weight = torch.ops.switchyard_cpu.kquant_packed_dequantize(module.packed, module.qtype, k,
                                                               torch.float32)
    _check(got, x, weight, dtype)


def test_a_malformed_call_raises_a_clear_error() -> None:
    module = Int4Linear(random_weight(32, 64, 32, 1, False), None, CPU, torch.float32)
    with pytest.raises(RuntimeError, match=r"q4_dense_mm: x must be .* \[M, 64\] matrix"):
        torch.ops.switchyard_cpu.q4_dense_mm(torch.randn(3, 32), module.packed,
                                             module.scale_zeros, module.group_size)
    with pytest.raises(RuntimeError, match="q4_dense_mm: bad group size"):
        torch.ops.switchyard_cpu.q4_dense_mm(torch.randn(3, 64), module.packed,
                                             module.scale_zeros, 12)
