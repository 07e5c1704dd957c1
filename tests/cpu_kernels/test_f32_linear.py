"""Our AVX2 FMA float32 linear (cpu_kernels/f32_linear.cpp) against a float64 reference,
through PrepackedLinear, compiled, and in the engine; its gate / up form (silu(gate) * up on
the tiles' sums) against the linear followed by torch's SiLU. The operator is AVX2 code,
built into both variants of our kernels, so it is tested wherever they build, and the engine
picks it with either variant (it beat oneDNN's float32 GEMMs on AVX-512 too)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends.cpu_kernels.build import active_variant
from backends.native.layers import cpu_linear
from backends.native.layers.cpu_linear import (
    PrepackedLinear,
    pack_for_f32_kernel,
    pack_for_f32_silu_mul,
)
from backends.native.models.llama import FusedLinear
from tests.cpu_kernels.linear_kernel_checks import (
    float64_reference,
    gate_up_projection,
    kernels_and_tokens,
    random_weights,
)

pytestmark = pytest.mark.skipif(active_variant() is None,
                                reason="our CPU kernels do not build here")


def _weights(n: int, k: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    return random_weights(n, k, bias, torch.float32)


def _assert_close_to_float64(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None) -> None:
    """Within a float32 sum of K products: K roundings of 2^-24 of the magnitudes (x2)."""
    exact, magnitude = float64_reference(x, weight, bias)
    error = (got.double() - exact).abs()
    allowed = magnitude * (x.shape[-1] + 1) * 2.0**-23
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert bool((error <= allowed).all()), f"worst excess {(error - allowed).max().item():.3g}"


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 64, 333])
@pytest.mark.parametrize(("n", "k"), [(16, 1), (48, 96), (80, 768), (2304, 768)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(rows: int, n: int, k: int, bias: bool) -> None:
    weight, b = _weights(n, k, bias)
    x = torch.randn(rows, k)
    got = torch.ops.switchyard_cpu.f32_linear(x, pack_for_f32_kernel(weight), b)
    _assert_close_to_float64(got, x, weight, b)


def test_leading_dimensions_are_kept() -> None:
    weight, bias = _weights(32, 40, bias=True)
    x = torch.randn(3, 5, 40)
    got = torch.ops.switchyard_cpu.f32_linear(x, pack_for_f32_kernel(weight), bias)
    assert got.shape == (3, 5, 32)
    _assert_close_to_float64(got.reshape(15, 32), x.reshape(15, 40), weight, bias)


@pytest.mark.parametrize("rows", [7, 100, 333])
def test_rows_split_where_output_columns_are_few(rows: int) -> None:
    """With more threads than column blocks, rows are dealt out in chunks too."""
    weight, bias = _weights(48, 96, bias=True)  # three blocks
    x = torch.randn(rows, 96)
    threads = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        got = torch.ops.switchyard_cpu.f32_linear(x, pack_for_f32_kernel(weight), bias)
    finally:
        torch.set_num_threads(threads)
    _assert_close_to_float64(got, x, weight, bias)


@pytest.mark.parametrize(("args", "message"), [
    (lambda w, x: (x.double(), w, None), "must be float32"),
    (lambda w, x: (x, w.reshape(-1), None), r"contiguous \[N / 16, K, 16\]"),
    (lambda w, x: (x[:, :32], w, None), "x has 32 features, the weight 64"),
    (lambda w, x: (x, w, torch.zeros(31)), r"float32 \[32\]"),
])
def test_malformed_calls_are_refused(args: Callable, message: str) -> None:
    weight, _ = _weights(32, 64, bias=False)
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.switchyard_cpu.f32_linear(*args(pack_for_f32_kernel(weight), x))


def _linear(n: int, k: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=bias)


def test_prepacked_linear_takes_it_where_the_shape_fits() -> None:
    fits, odd = _linear(160, 96), _linear(20, 96)  # 20 output columns: not blocks of 16
    x = torch.randn(5, 96)
    with torch.inference_mode():
        ours = PrepackedLinear(fits, f32_kernel=True)
        fallback = PrepackedLinear(odd, f32_kernel=True)
        assert (ours.kernel, fallback.kernel) == ("f32", "onednn")
        assert PrepackedLinear(fits).kernel == "onednn"  # only when asked
        assert not cpu_linear.uses_f32_kernel(fits.weight.detach().to(torch.bfloat16))
        _assert_close_to_float64(ours(x), x, fits.weight, fits.bias)
        torch.testing.assert_close(fallback(x), F.linear(x, odd.weight, odd.bias))


@pytest.mark.parametrize(("variant", "kernel"), [("avx2", "f32"), ("avx512-vnni", "f32"),
                                                 (None, "onednn")])
def test_taken_wherever_our_kernels_are_built(monkeypatch: pytest.MonkeyPatch,
                                              variant: str | None, kernel: str) -> None:
    monkeypatch.setattr(cpu_linear, "active_variant", lambda: variant)
    assert PrepackedLinear(_linear(160, 96), f32_kernel=True).kernel == kernel


def test_compiles_as_an_opaque_op() -> None:
    packed = PrepackedLinear(_linear(160, 96), f32_kernel=True)
    compiled = torch.compile(lambda x: torch.relu(packed(x)), dynamic=True, fullgraph=True)
    with torch.inference_mode():
        for rows in (3, 9, 40):
            x = torch.randn(rows, 96)
            assert torch.equal(compiled(x), torch.relu(packed(x)))


def test_engine_tokens_do_not_change(tiny_model: Callable[[str], Path]) -> None:
    kernels, outputs = kernels_and_tokens(tiny_model("llama_gqa"), "float32", "f32_linear_kernel")
    assert kernels == ["onednn", "f32+silu_mul"]
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_any_thread_count_gives_the_one_thread_result(threads: int) -> None:
    """Whatever the thread count, the column blocks are shared out so that every output is
    written once and computed as one thread computes it: bit-identical to one thread's result
    (rows split where blocks are few: test_rows_split_where_output_columns_are_few)."""
    weight, bias = _weights(2304, 768, bias=True)
    x = torch.randn(64, 768)
    packed = pack_for_f32_kernel(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.ops.switchyard_cpu.f32_linear(x, packed, bias)
        torch.set_num_threads(threads)
        for _ in range(20):
            assert torch.equal(torch.ops.switchyard_cpu.f32_linear(x, packed, bias), alone)
    finally:
        torch.set_num_threads(before)


def _silu_mul_unfused(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    plain = torch.ops.switchyard_cpu.f32_linear(x, pack_for_f32_kernel(weight), None)
    gate, up = plain.chunk(2, -1)
    return F.silu(gate) * up


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 333])
@pytest.mark.parametrize(("f", "k"), [(8, 1), (24, 96), (2048, 768)])
def test_silu_mul_is_the_linear_then_silu(rows: int, f: int, k: int) -> None:
    """The gate and up sums are the plain kernel's (same k order); only SiLU and the product
    round on their own: within 4 ulps of torch's. A float64 check catches a misplaced column."""
    weight, _ = _weights(2 * f, k, bias=False)
    x = torch.randn(rows, k)
    got = torch.ops.switchyard_cpu.f32_silu_mul_linear(x, pack_for_f32_silu_mul(weight))
    assert got.shape == (rows, f) and got.dtype == torch.float32
    torch.testing.assert_close(got, _silu_mul_unfused(x, weight), rtol=4 * 2.0**-23, atol=1e-30)
    exact_gate, exact_up = (x.double() @ weight.double().t()).chunk(2, -1)
    exact = F.silu(exact_gate) * exact_up
    assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


def test_silu_mul_saturates_without_overflow() -> None:
    """Gates far past exp's range: silu(g) is g for large g and 0 for very negative g."""
    weight = torch.zeros(32, 4)
    weight[:16, 0] = torch.tensor([200.0, -200.0, 90.0, -90.0] * 4)  # gates
    weight[16:, 1] = 1.0  # up = x[1]
    x = torch.tensor([[1.0, 3.0, 0.0, 0.0]])
    got = torch.ops.switchyard_cpu.f32_silu_mul_linear(x, pack_for_f32_silu_mul(weight))
    assert got[0, :4].tolist() == [600.0, 0.0, 270.0, pytest.approx(-90 * 3 * torch.e**-90)]
    assert bool(torch.isfinite(got).all())


def _gate_up(f: int, k: int, marked: bool = True, bias: bool = False) -> FusedLinear:
    return gate_up_projection(f, k, torch.float32, marked, bias)


def test_prepacked_gate_up_fuses_silu_mul() -> None:
    gate_up = _gate_up(24, 96)
    x = torch.randn(5, 96)
    with torch.inference_mode():
        fused = PrepackedLinear(gate_up, f32_kernel=True)
        assert fused.fuses_silu_mul
        gate, up = F.linear(x, gate_up.weight).chunk(2, -1)
        torch.testing.assert_close(fused.silu_mul(x), F.silu(gate) * up)
        with pytest.raises(RuntimeError, match="packed for silu_mul"):
            fused(x)


@pytest.mark.parametrize(("linear", "f32_kernel"), [
    (lambda: _gate_up(24, 96, marked=False), True),  # not a gate / up projection
    (lambda: _gate_up(24, 96, bias=True), True),
    (lambda: _gate_up(20, 96), True),  # 20 outputs a half: not blocks of 8
    (lambda: _gate_up(24, 96), False),  # oneDNN
])
def test_silu_mul_fused_only_where_it_fits(linear: Callable[[], FusedLinear],
                                           f32_kernel: bool) -> None:
    assert not PrepackedLinear(linear(), f32_kernel=f32_kernel).fuses_silu_mul
