"""Int4Linear's reads of its packing (`dequantize_kn`, `rows()`, both matmul paths) against a
plain dequantization of the same weights, in one process: torch's CPU int4 packing, or the
int8-dot kernels' own where they run (SWITCHYARD_CPU_KERNELS).

torch reads ATEN_CPU_CAPABILITY once per process, so test_int4_layout.py runs this module as a
script under each instruction set's packing (`python -m tests.quantized.int4_layout_check`)."""

from __future__ import annotations

import torch

from backends.quantized.affine import AffineInt4, AffineInt8
from backends.quantized.int4_layout import cpu_int4_layout
from backends.quantized.int4_linear import (
    DENSE_MIN_ROWS,
    INT8_DOT_DENSE_MIN_ROWS,
    KERNEL_DTYPE,
    Int4Linear,
)

CPU = torch.device("cpu")
# 96 rows: a whole number of AVX2's 32-row blocks but not of AVX-512's 64-row ones
SHAPES = [(128, 256, 32), (96, 128, 64), (320, 128, 128)]  # (out, in, group)


def random_weight(n: int, k: int, group: int, seed: int, act_order: bool) -> AffineInt4:
    """Scales and zeros already bf16 values: the kernels keep them in bf16, so the reference
    and the module dequantize the very same numbers."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).bfloat16().float()
    zero = (torch.randn(n, k // group, generator=gen) * 0.01).bfloat16().float()
    perm = torch.randperm(k, generator=gen) if act_order else None
    return AffineInt4(q, scale, zero, group, perm)


def int8_halves(n: int, k: int, seed: int) -> AffineInt4:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.001 + 1e-4).bfloat16().float()
    return AffineInt8(q, scale, torch.full_like(scale, 128.0), 32).as_int4_halves()


def reference_kn(weight: AffineInt4) -> torch.Tensor:
    """[K, N] in the kernel's column order (the input permuted by `perm`), float64."""
    dense = weight.dense().double()  # [N, in_features], original column order
    return (dense if weight.perm is None else dense[:, weight.perm]).t()


def check_module(weight: AffineInt4, dtype: torch.dtype) -> None:
    module = Int4Linear(weight, None, CPU, dtype)
    layout = cpu_int4_layout()
    assert layout is not None, "this CPU's int4 packing layout was not recognised"
    int8_dot = module.kernel == "cpu-int8-dot"
    assert module.dense_ok == (int8_dot or layout.supports(weight.out_features))
    want_kn = reference_kn(weight)  # [K, N], kernel column order
    want = weight.dense().double()  # [N, in_features], the input's order
    exact = 1e-6 if dtype == torch.float32 else 1e-2  # fp32 rounding / one bf16 step
    if int8_dot:  # zero - 8 scale held in float16: 2^-11 of it, ~1e-4 of the largest weight
        exact = max(exact, 1e-3)
    if module.dense_ok:
        got = module.dequantize_kn()
        assert got.dtype == dtype
        _close(got, want_kn, exact, "dequantize_kn")
        index = torch.tensor([0, weight.out_features - 1, 33, 65, 7, 33])
        rows = module.rows(index)
        assert rows.dtype == dtype
        _close(rows, want[index], exact, "rows")
    _check_forward(module, want, dtype)


def _check_forward(module: Int4Linear, weight: torch.Tensor, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    int8_dot = module.kernel == "cpu-int8-dot"
    threshold = INT8_DOT_DENSE_MIN_ROWS if int8_dot else DENSE_MIN_ROWS
    for rows in (3, threshold + 8):
        x = torch.randn(rows, module.in_features, generator=gen).to(dtype)
        got = module(x)
        assert got.dtype == dtype
        dense_path = module.dense_ok and rows >= threshold
        # torch's kernel rounds inputs to bf16; int8-dot quantizes them itself (~0.6%)
        fed = x if dense_path or int8_dot else x.to(KERNEL_DTYPE)
        want = fed.double() @ weight.t()
        # the kernel's bf16 output (or a bf16 engine): a few bf16 steps of the largest output
        tol = 1e-5 if dense_path and dtype == torch.float32 else 2e-2
        if int8_dot and tol < 1e-3:  # its float16 zeros (see `exact` above)
            tol = 1e-3
        _close(got, want, tol, f"forward, {rows} rows")


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    diff = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert diff <= tol * scale, f"{what}: max diff {diff:.3g} > {tol} x {scale:.3g}"


def check_all() -> str:
    for dtype in (torch.float32, torch.bfloat16):
        for seed, (n, k, group) in enumerate(SHAPES):
            check_module(random_weight(n, k, group, seed, act_order=seed == 1), dtype)
        check_module(int8_halves(128, 64, 7), dtype)
    layout = cpu_int4_layout()
    assert layout is not None
    kernel = Int4Linear(random_weight(*SHAPES[0], 0, False), None, CPU, torch.float32).kernel
    return f"{torch.backends.cpu.get_cpu_capability()} {kernel} block {layout.block}"


if __name__ == "__main__":
    print(check_all())
