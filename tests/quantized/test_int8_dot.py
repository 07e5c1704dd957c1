"""The int8-dot kernels (backends/cpu_kernels/int8_dot.cpp, int4_dequant.cpp): their layout,
their products and dequantized weights against a float64 reference, their choice per CPU, and
their AVX2 code in a process where torch dispatches to AVX2. Int4Linear on top of them is
checked in int4_layout_check.py."""

from __future__ import annotations

import pytest
import torch

from backends.cpu_kernels.build import active_variant, suitable_variant
from backends.quantized import int8_dot_layout as layout
from tests.quantized.helpers import has_avx2, run_in_child

VNNI_FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})


def _weights(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).half().float()
    zero = (torch.randn(n, k // group, generator=gen) * 0.05).half().float()
    return q, scale, zero


def _dense(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    n, k = q.shape
    w = q.double().view(n, -1, group) * scale.double().unsqueeze(-1) + zero.double().unsqueeze(-1)
    return w.view(n, k)


@pytest.mark.parametrize(("flags", "capability", "setting", "want"), [
    (VNNI_FLAGS, "AVX512", "auto", "avx512-vnni"),
    (VNNI_FLAGS, "AVX2", "auto", "avx2"),  # torch held to AVX2: so are we
    (VNNI_FLAGS, "DEFAULT", "auto", None),
    (AVX2_FLAGS, "AVX2", "auto", "avx2"),
    (AVX2_FLAGS, "AVX2", "avx512-vnni", None),  # asked for what the CPU lacks
    (VNNI_FLAGS, "AVX512", "avx2", "avx2"),
    (VNNI_FLAGS, "AVX512", "off", None),
    (frozenset({"sse4_2"}), "DEFAULT", "auto", None),
    (None, "AVX512", "auto", None),  # no flags to read: no guess
])
def test_the_variant_follows_the_cpu_torch_and_the_setting(flags, capability, setting, want):
    assert suitable_variant(flags, capability, setting) == want


def test_an_unknown_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="SWITCHYARD_CPU_KERNELS"):
        suitable_variant(VNNI_FLAGS, "AVX512", "avx9")


def test_layout_round_trips() -> None:
    q, scale, zero = _weights(48, 128, 64, 0)
    packed, scale_zero = layout.pack(q), layout.pack_scales(scale, zero)
    assert packed.shape == (3, 16, 16, 4) and scale_zero.shape == (3, 2, 2, 16)
    assert torch.equal(layout.unpack_kn(packed, torch.uint8), q.t())
    index = torch.tensor([0, 47, 16, 15, 33, 33])
    assert torch.equal(layout.rows(packed, index), q[index])
    got_scale, got_zero = layout.scale_rows(scale_zero, index)
    assert torch.equal(got_scale.float(), scale[index])
    assert torch.equal(got_zero.float(), zero[index])
    kn_scale, kn_zero = layout.scale_kn(scale_zero)
    assert torch.equal(kn_scale.float(), scale.t()) and torch.equal(kn_zero.float(), zero.t())


def test_scales_float16_cannot_hold_are_refused() -> None:
    q, scale, zero = _weights(16, 64, 32, 1)
    scale[3, 1] = 1e6
    assert layout.pack_scales(scale, zero) is None
    assert not layout.fits(20, 64, 32) and not layout.fits(16, 48, 32) and layout.fits(16, 64, 32)


# Max error / largest output, float32 inputs: one int8 pass ~0.5-0.8% (measured), two passes
# ~0.05%; bf16 outputs add a bf16 step (0.4%).
TOLERANCE = {(False, torch.float32): 0.02, (True, torch.float32): 0.002,
             (False, torch.bfloat16): 0.02, (True, torch.bfloat16): 0.01}


def check_products() -> str:
    """q4_mm against float64 over row counts around the kernel's 8-row tiles, groups 32-128,
    float32 and bf16 inputs, one and two int8 passes; a row alone (decode at batch 1, its own
    code) gives the bits it gets inside an 8-row tile."""
    variant = active_variant()
    assert variant is not None, "the int8-dot kernels did not build here"
    for seed, (n, k, group) in enumerate([(64, 256, 32), (48, 512, 128), (16, 96, 32)]):
        q, scale, zero = _weights(n, k, group, seed)
        packed, scale_zero = layout.pack(q), layout.pack_scales(scale, zero)
        weight = _dense(q, scale, zero, group)
        for rows in (1, 7, 8, 19):
            for (fine, dtype), tol in TOLERANCE.items():
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
                got = torch.ops.switchyard_cpu.q4_mm(x, packed, scale_zero, group, fine)
                assert got.dtype == dtype and got.shape == (rows, n)
                want = x.double() @ weight.t()
                diff = (got.double() - want).abs().max().item()
                assert diff <= tol * want.abs().max().item(), (n, k, group, rows, fine, dtype)
                alone = torch.ops.switchyard_cpu.q4_mm(x[3:4].contiguous(), packed, scale_zero,
                                                       group, fine)
                assert rows < 8 or torch.equal(alone[0], got[3]), "a row alone != in a tile"
    check_dequantization()
    return variant


def check_dequantization() -> None:
    """q4_dequantize_kn against float64: float32 to its rounding, bfloat16 to one rounding."""
    for seed, (n, k, group) in enumerate([(64, 256, 32), (48, 512, 128), (16, 96, 32)]):
        q, scale, zero = _weights(n, k, group, seed)
        packed, scale_zero = layout.pack(q), layout.pack_scales(scale, zero)
        want = _dense(q, scale, zero, group).t()
        for dtype, tol in ((torch.float32, 2**-22), (torch.bfloat16, 2**-8)):
            got = torch.ops.switchyard_cpu.q4_dequantize_kn(packed, scale_zero, group, dtype)
            assert got.dtype == dtype and got.shape == (k, n)
            diff = (got.double() - want).abs() - tol * want.abs()
            assert diff.max().item() <= 1e-12, (n, k, group, dtype)


def test_products_match_float64() -> None:
    if active_variant() is None:
        pytest.skip("no int8-dot kernels for this CPU")
    check_products()


def test_avx2_code_where_torch_dispatches_to_avx2() -> None:
    if not has_avx2():
        pytest.skip("this CPU has no AVX2")
    out = run_in_child("tests.quantized.test_int8_dot", "avx2")
    assert out.split() == ["avx2"]


def test_a_malformed_call_raises_a_clear_error() -> None:
    if active_variant() is None:
        pytest.skip("no int8-dot kernels for this CPU")
    q, scale, zero = _weights(16, 64, 32, 2)
    packed, scale_zero = layout.pack(q), layout.pack_scales(scale, zero)
    with pytest.raises(RuntimeError, match="K mismatch"):
        torch.ops.switchyard_cpu.q4_mm(torch.randn(2, 32), packed, scale_zero, 32, False)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.switchyard_cpu.q4_mm(torch.randn(2, 64).half(), packed, scale_zero, 32,
                                           False)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.switchyard_cpu.q4_dequantize_kn(packed, scale_zero, 32, torch.float16)
    with pytest.raises(RuntimeError, match="bad group size"):
        torch.ops.switchyard_cpu.q4_dequantize_kn(packed, scale_zero, 12, torch.float32)


if __name__ == "__main__":
    print(check_products())
