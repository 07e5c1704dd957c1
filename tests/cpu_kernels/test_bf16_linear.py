"""Our AVX-512-BF16 linear (cpu_kernels/bf16_linear.cpp) against a float64 reference, through
PrepackedLinear, compiled, and in the engine; its gate / up form (silu(gate) * up on the
tile's float32 sums, rounded once) too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends.cpu_kernels.build import bf16_linear_built
from backends.native.layers import cpu_linear
from backends.native.layers.cpu_linear import (
    PrepackedLinear,
    pack_for_bf16_kernel,
    pack_for_bf16_silu_mul,
)
from backends.native.models.llama import FusedLinear
from backends.quantized.resident import resident_bytes
from tests.cpu_kernels.linear_kernel_checks import (
    float64_reference,
    gate_up_projection,
    kernels_and_tokens,
    random_weights,
)

pytestmark = pytest.mark.skipif(
    not bf16_linear_built(), reason="this CPU has no AVX-512-BF16 (or our kernels are off): "
    "bf16 linears stay on oneDNN, which test_cpu_linear.py covers")


def _weights(n: int, k: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    return random_weights(n, k, bias, torch.bfloat16)


def _onednn_amx_path(rows: int) -> bool:
    """Where the CPU has AMX, from 64 rows the kernel hands the product to oneDNN's AMX matmul
    (bf16_linear.cpp's kAmxMinRows)."""
    return rows >= 64 and torch.cpu._is_amx_tile_supported()


def _assert_close_to_float64(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None) -> None:
    """Within bf16's rounding of the exact result (2^-9 relative) plus float32 summation."""
    exact, magnitude = float64_reference(x, weight, bias)
    error = (got.double() - exact).abs()
    allowed = exact.abs() * 2.0**-8 + magnitude * 2.0**-20
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert bool((error <= allowed).all()), f"worst excess {(error - allowed).max().item():.3g}"


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 23, 64, 333])
@pytest.mark.parametrize(("n", "k"), [(16, 2), (48, 96), (80, 768), (2304, 768)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(rows: int, n: int, k: int, bias: bool) -> None:
    weight, b = _weights(n, k, bias)
    x = torch.randn(rows, k).to(torch.bfloat16)
    got = torch.ops.switchyard_cpu.bf16_linear(x, pack_for_bf16_kernel(weight), b)
    _assert_close_to_float64(got, x, weight, b)


@pytest.mark.parametrize("rows", [9, 100, 333])
def test_rows_split_where_output_columns_are_few(rows: int) -> None:
    """With more threads than pairs of column blocks, rows are dealt out in chunks too."""
    weight, bias = _weights(48, 96, bias=True)  # two pairs of blocks, the second one short
    x = torch.randn(rows, 96).to(torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        got = torch.ops.switchyard_cpu.bf16_linear(x, pack_for_bf16_kernel(weight), bias)
    finally:
        torch.set_num_threads(threads)
    _assert_close_to_float64(got, x, weight, bias)


def test_agrees_with_onednn_but_for_rounding() -> None:
    weight, bias = _weights(256, 512, bias=True)
    x = torch.randn(40, 512).to(torch.bfloat16)
    ours = torch.ops.switchyard_cpu.bf16_linear(x, pack_for_bf16_kernel(weight), bias)
    onednn = F.linear(x, weight, bias)
    ulp = onednn.float().abs() * 2.0**-7  # one bf16 step at most
    assert bool(((ours.float() - onednn.float()).abs() <= ulp + 1e-6).all())
    assert (ours == onednn).float().mean() > 0.9


def test_keeps_leading_dimensions_and_empty_inputs() -> None:
    weight, bias = _weights(32, 64, bias=True)
    packed = pack_for_bf16_kernel(weight)
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    got = torch.ops.switchyard_cpu.bf16_linear(x, packed, bias)
    assert got.shape == (3, 5, 32)
    _assert_close_to_float64(got.reshape(15, 32), x.reshape(15, 64), weight, bias)
    assert torch.ops.switchyard_cpu.bf16_linear(x[:0], packed, None).shape == (0, 5, 32)


def test_a_strided_input_is_read_right() -> None:
    weight, _ = _weights(32, 64, bias=False)
    wide = torch.randn(6, 128).to(torch.bfloat16)
    x = wide[:, ::2]  # not contiguous
    got = torch.ops.switchyard_cpu.bf16_linear(x, pack_for_bf16_kernel(weight), None)
    _assert_close_to_float64(got, x.contiguous(), weight, None)


@pytest.mark.parametrize(("args", "message"), [
    (lambda w, x: (x.float(), w, None), "must be bfloat16"),
    (lambda w, x: (x, w.reshape(-1), None), r"contiguous \[N / 16, K / 2, 16, 2\]"),
    (lambda w, x: (x[:, :32], w, None), "x has 32 features, the weight 64"),
    (lambda w, x: (x, w, torch.zeros(31, dtype=torch.bfloat16)), r"bfloat16 \[32\]"),
])
def test_malformed_calls_are_refused(args: Callable, message: str) -> None:
    weight, _ = _weights(32, 64, bias=False)
    x = torch.randn(4, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.switchyard_cpu.bf16_linear(*args(pack_for_bf16_kernel(weight), x))


def _linear(n: int, k: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=bias).to(torch.bfloat16)


def test_prepacked_linear_takes_it_where_the_shape_fits() -> None:
    fits, odd = _linear(160, 96), _linear(20, 96)  # 20 output columns: not blocks of 16
    x = torch.randn(5, 96).to(torch.bfloat16)
    with torch.inference_mode():
        ours, fallback = PrepackedLinear(fits, bf16_kernel=True), PrepackedLinear(odd, True)
        assert (ours.kernel, fallback.kernel) == ("bf16", "onednn")
        assert PrepackedLinear(fits).kernel == "onednn"  # only when asked
        _assert_close_to_float64(ours(x), x, fits.weight, fits.bias)
        assert torch.equal(fallback(x), F.linear(x, odd.weight, odd.bias))
    assert resident_bytes(ours) == resident_bytes(PrepackedLinear(fits))


def test_not_taken_where_the_kernel_is_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_linear, "bf16_linear_built", lambda: False)
    assert PrepackedLinear(_linear(160, 96), bf16_kernel=True).kernel == "onednn"


def test_compiles_as_an_opaque_op() -> None:
    packed = PrepackedLinear(_linear(160, 96), bf16_kernel=True)
    compiled = torch.compile(lambda x: torch.relu(packed(x)), dynamic=True, fullgraph=True)
    with torch.inference_mode():
        for rows in (3, 9, 40):
            x = torch.randn(rows, 96).to(torch.bfloat16)
            assert torch.equal(compiled(x), torch.relu(packed(x)))


def test_engine_tokens_do_not_change(tiny_model: Callable[[str], Path]) -> None:
    kernels, outputs = kernels_and_tokens(tiny_model("llama_gqa"), "bfloat16", "bf16_linear_kernel")
    assert kernels == ["onednn", "bf16+silu_mul"]
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 64, 333])
@pytest.mark.parametrize(("f", "k"), [(16, 2), (48, 96), (2048, 768)])
def test_silu_mul_matches_float64(rows: int, f: int, k: int) -> None:
    """silu(gate) * up from the exact sums, rounded to bf16 once: within one bf16 rounding (and
    float32 summation) of the float64 result; a gate or up column from the wrong block, or the
    unfused path's three roundings, would not be."""
    weight, _ = _weights(2 * f, k, bias=False)
    x = torch.randn(rows, k).to(torch.bfloat16)
    got = torch.ops.switchyard_cpu.bf16_silu_mul_linear(x, pack_for_bf16_silu_mul(weight))
    exact_gate, exact_up = (x.double() @ weight.double().t()).chunk(2, -1)
    exact = F.silu(exact_gate) * exact_up
    sums = (x.double().abs() @ weight.double().abs().t()).chunk(2, -1)
    float32_sums = (sums[0] * exact_up.abs() + sums[1] * exact_gate.abs()) * 2.0**-20
    allowed = exact.abs() * 2.0**-8 + float32_sums + 1e-30
    if _onednn_amx_path(rows):  # gate and up rounded before silu(gate) * up: |g| amplifies
        allowed = allowed + exact.abs() * 2.0**-7 * (1 + exact_gate.abs())
    assert got.shape == (rows, f) and got.dtype == torch.bfloat16
    error = (got.double() - exact).abs()
    assert bool((error <= allowed).all()), f"worst excess {(error - allowed).max().item():.3g}"


@pytest.mark.parametrize("silu_mul", [False, True])
def test_prefill_rows_over_several_slices(silu_mul: bool) -> None:
    """100 rows of a weight of three 16 MB slices (2048 columns of 4096 each): on AMX CPUs
    oneDNN's path (a slice unpacked at the wrong columns would be far off), elsewhere the
    tiles; both within their rounding of the float64 product."""
    weight, bias = _weights(4352, 4096, bias=not silu_mul)
    x = torch.randn(100, 4096).to(torch.bfloat16)
    if not silu_mul:
        got = torch.ops.switchyard_cpu.bf16_linear(x, pack_for_bf16_kernel(weight), bias)
        _assert_close_to_float64(got, x, weight, bias)
        return
    got = torch.ops.switchyard_cpu.bf16_silu_mul_linear(x, pack_for_bf16_silu_mul(weight))
    gate, up = (x.double() @ weight.double().t()).chunk(2, -1)
    exact = F.silu(gate) * up
    error = (got.double() - exact).abs()
    allowed = exact.abs() * 2.0**-6 * (1 + gate.abs()) + 1e-3 * exact.abs().max()
    assert bool((error <= allowed).all()), f"worst excess {(error - allowed).max().item():.3g}"


def test_silu_mul_saturates_without_overflow() -> None:
    """Gates far past exp's range: silu(g) is g for large g and 0 for very negative g."""
    weight = torch.zeros(64, 4)
    weight[:32, 0] = torch.tensor([200.0, -200.0, 90.0, -90.0] * 8)  # gates
    weight[32:, 1] = 1.0  # up = x[1]
    x = torch.tensor([[1.0, 3.0, 0.0, 0.0]]).to(torch.bfloat16)
    packed = pack_for_bf16_silu_mul(weight.to(torch.bfloat16))
    got = torch.ops.switchyard_cpu.bf16_silu_mul_linear(x, packed).float()
    assert got[0, :4].tolist() == [600.0, 0.0, 270.0, pytest.approx(-90 * 3 * torch.e**-90,
                                                                    rel=2.0**-8)]
    assert bool(torch.isfinite(got).all())


def _gate_up(f: int, k: int, marked: bool = True, bias: bool = False) -> FusedLinear:
    return gate_up_projection(f, k, torch.bfloat16, marked, bias)


def test_prepacked_gate_up_fuses_silu_mul() -> None:
    gate_up = _gate_up(48, 96)
    x = torch.randn(5, 96).to(torch.bfloat16)
    with torch.inference_mode():
        fused = PrepackedLinear(gate_up, bf16_kernel=True)
        assert fused.kernel == "bf16" and fused.fuses_silu_mul
        expected = torch.ops.switchyard_cpu.bf16_silu_mul_linear(
            x, pack_for_bf16_silu_mul(gate_up.weight))
        assert torch.equal(fused.silu_mul(x), expected)
        with pytest.raises(RuntimeError, match="packed for silu_mul"):
            fused(x)


def test_silu_mul_compiles_as_an_opaque_op() -> None:
    fused = PrepackedLinear(_gate_up(48, 96), bf16_kernel=True)
    compiled = torch.compile(lambda x: torch.relu(fused.silu_mul(x)), dynamic=True,
                             fullgraph=True)
    with torch.inference_mode():
        for rows in (3, 9, 40):
            x = torch.randn(rows, 96).to(torch.bfloat16)
            assert torch.equal(compiled(x), torch.relu(fused.silu_mul(x)))


@pytest.mark.parametrize(("linear", "bf16_kernel"), [
    (lambda: _gate_up(48, 96, marked=False), True),  # not a gate / up projection
    (lambda: _gate_up(48, 96, bias=True), True),
    (lambda: _gate_up(24, 96), True),  # 24 outputs a half: not blocks of 16
    (lambda: _gate_up(48, 96), False),  # oneDNN
])
def test_silu_mul_fused_only_where_it_fits(linear: Callable[[], FusedLinear],
                                           bf16_kernel: bool) -> None:
    assert not PrepackedLinear(linear(), bf16_kernel=bf16_kernel).fuses_silu_mul


def test_silu_mul_refuses_an_odd_block_count() -> None:
    weight, _ = _weights(48, 96, bias=False)  # three blocks: not gate / up pairs
    x = torch.randn(2, 96).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="pairs of gate / up blocks"):
        torch.ops.switchyard_cpu.bf16_silu_mul_linear(x, pack_for_bf16_kernel(weight))
