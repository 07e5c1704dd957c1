"""torch's CPU int4 packing differs per instruction set (64-row blocks on AVX-512, 32-row ones
on AVX2, pairs of rows without vector kernels). The layout is read off a probe once per
process; Int4Linear's unpacking, row reads and both matmul paths are checked against a plain
dequantization here and, since torch reads ATEN_CPU_CAPABILITY once per process, in a child
process under each packing this machine can be made to use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.quantized.int4_layout import Int4PackLayout, derive_layout, source_positions
from tests.quantized.helpers import has_avx2, run_in_child
from tests.quantized.int4_layout_check import check_all

# the block each dispatch level packs in (torch 2.13): what a child process must report
BLOCKS = {"AVX512": 64, "AVX2": 32, "DEFAULT": 32}


def test_this_process_layout_reads_back_exactly() -> None:
    capability = torch.backends.cpu.get_cpu_capability()
    reported = check_all()
    assert reported.split()[-1] == str(BLOCKS.get(capability, reported.split()[-1]))


@pytest.mark.parametrize(("capability", "cpu_kernels", "kernel"), [
    ("avx512", "off", "cpu-int4pack"), ("avx2", "off", "cpu-int4pack"),
    ("avx2", "auto", "cpu-int8-dot"), ("default", "auto", "cpu-int4pack"),
])
def test_layout_under_another_instruction_set(
    capability: str, cpu_kernels: str, kernel: str,
) -> None:
    """torch's packing under each ISA (our kernels off), and the int8-dot kernels' AVX2 code where
    torch dispatches to AVX2 (none without vector kernels)."""
    if capability == "avx2" and not has_avx2():
        pytest.skip("this CPU has no AVX2: torch cannot dispatch to its AVX2 kernels")
    if capability == "avx512" and "avx512f" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX-512")
    out = run_in_child("tests.quantized.int4_layout_check", capability,
                       cpu_kernels=cpu_kernels).split()
    assert out[0] == capability.upper()  # torch really dispatched there
    assert out[1] == kernel
    assert int(out[-1]) == BLOCKS[out[0]]


def test_a_packing_of_another_form_is_refused() -> None:
    source = source_positions(256, 64)
    layout = derive_layout(source, 256, 64)
    assert isinstance(layout, Int4PackLayout)
    swapped = source.clone()
    swapped[[5, 900]] = swapped[[900, 5]]  # two weights stored out of the block pattern
    assert derive_layout(swapped, 256, 64) is None
