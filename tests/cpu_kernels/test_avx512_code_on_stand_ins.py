"""Our kernels' AVX-512 code (SWITCHYARD_VNNI: simd.h's 16-lane vectors in both attention
kernels and the fused decode layers, int8_dot's VNNI lane blocks, the BF16 linear) on a CPU
without AVX-512: built with AVX2 flags on scalar stand-ins for the _mm512 intrinsics
(avx512_stand_ins.h) and held to the float64 checks the real code passes elsewhere in the
suite, so that its indexing, tails and masks are checked on whichever CPU CI has. The fused
decode layers' 16-lane code is compared with the AVX2 build's. Skipped where the CPU has
AVX-512 VNNI: the rest of the suite runs the real instructions there.

Each check runs in a child process: it points `torch.ops.switchyard_cpu` at the stand-in
library, which must not leak into other tests.

    python -m tests.cpu_kernels.test_avx512_code_on_stand_ins LIBRARY \
        attention|q4|bf16|decode_layers
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.cpu_kernels import build
from backends.machine.cpu_dtype import read_cpuinfo
from backends.quantized import int8_dot_layout
from tests.quantized import test_int8_dot
from tests.quantized.helpers import ROOT

HEADER = Path(__file__).with_name("avx512_stand_ins.h")
NAMESPACE = "switchyard_avx512_stand_ins"
# Namespaces renamed, so that the stand-in build and the real one load side by side.
STAND_IN_FLAGS = ("-DSWITCHYARD_VNNI", "-include", str(HEADER), f"-Dswitchyard_cpu={NAMESPACE}",
                  "-Dswitchyard=switchyard_stand_ins",
                  "-Dswitchyard_simd=switchyard_simd_stand_ins",
                  "-Dswitchyard_slices=switchyard_slices_stand_ins")
CHECKS = ("attention", "q4", "bf16", "decode_layers")
# The sources with 16-lane code, and int4_dequant.cpp for the int8-dot check's dequantization.
STAND_IN_SOURCES = ("int8_dot", "int4_dequant", "paged_attention", "prefill_attention",
                    "decode_layers", "bf16_linear")


def _cpu_flags() -> frozenset[str]:
    return read_cpuinfo()[1] or frozenset()


pytestmark = pytest.mark.skipif(
    "avx512_vnni" in _cpu_flags() or build.active_variant() != "avx2",
    reason="the CPU runs the real AVX-512 code (or no AVX2 kernels are built here)")


def stand_in_library() -> Path:
    """The kernel sources with 16-lane code built as the AVX-512 variant on the stand-ins (AVX2
    instructions only), cached beside the real library (~1 min to build on 2 cores)."""
    return build.built_library(build.KernelBuild(
        "avx2", sources=tuple(path for path in build.SOURCES if path.stem in STAND_IN_SOURCES),
        extra_flags=STAND_IN_FLAGS, extra_headers=(HEADER,), prefix=NAMESPACE))


@pytest.fixture(scope="module")
def library() -> Path:
    return stand_in_library()


@pytest.mark.parametrize("check", CHECKS)
def test_avx512_code_passes_on_stand_ins(library: Path, check: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "SWITCHYARD_CPU_KERNELS": "avx2"}
    done = subprocess.run([sys.executable, "-m", __name__, str(library), check], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split()[-1] == f"{check}:ok"


# --- in the child ---------------------------------------------------------------------------

def _use_stand_ins(library: str) -> object:
    """Loads the real AVX2 kernels and the stand-in build, points `torch.ops.switchyard_cpu`
    (and the checks' view of the build) at the stand-ins; the real namespace, for comparing."""
    assert build.active_variant() == "avx2"
    real = torch.ops.switchyard_cpu
    torch.ops.load_library(library)
    torch.ops.switchyard_cpu = getattr(torch.ops, NAMESPACE)
    build.active_variant = lambda: "avx512-vnni (stand-ins)"
    build.bf16_linear_built = lambda: True
    return real


def _check_attention() -> None:
    from tests.cpu_kernels import test_attention_kernels as kernels
    torch.set_num_threads(1)
    kernels.check_against_float64()
    kernels.check_prefill_against_float64()
    torch.set_num_threads(2)  # decode rows split over blocks
    kernels.check_against_float64()


def _check_q4() -> None:
    torch.set_num_threads(1)
    test_int8_dot.check_products()


def _check_bf16() -> None:
    from tests.cpu_kernels import test_bf16_linear as linear
    torch.set_num_threads(1)
    for rows, (n, k), bias in itertools.product([1, 2, 7, 8, 9, 16, 23, 64],
                                                [(16, 2), (48, 96), (80, 768)], [False, True]):
        linear.test_matches_float64(rows, n, k, bias)
    linear.test_rows_split_where_output_columns_are_few(9)
    linear.test_keeps_leading_dimensions_and_empty_inputs()
    linear.test_a_strided_input_is_read_right()
    for rows, (f, k) in itertools.product([1, 7, 9, 64], [(16, 2), (48, 96)]):
        linear.test_silu_mul_matches_float64(rows, f, k)
    linear.test_silu_mul_saturates_without_overflow()


def _check_decode_layers(real: object) -> None:
    """Head sizes of 1, 4 and 5 vectors, blocks of 4 (below 16 lanes), 8 and 16, GQA."""
    torch.set_num_threads(1)
    for seed, shape in enumerate([(1, 96, 6, 2, 16, 64, 16, 2, 32),
                                  (3, 160, 2, 1, 80, 96, 4, 2, 32),
                                  (2, 64, 4, 4, 16, 32, 8, 3, 32),
                                  (5, 192, 3, 1, 64, 128, 16, 2, 64)]):
        (got, got_k, got_v), (want, want_k, want_v) = (
            _decode_layers(namespace, *shape, seed=seed)
            for namespace in (torch.ops.switchyard_cpu, real))
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), shape
        for a, b in zip(got_k + got_v, want_k + want_v, strict=True):
            assert (a - b).abs().max().item() <= 1e-4, shape


def _decode_layers(namespace: object, rows: int, hidden: int, heads: int, kv_heads: int,
                   head_dim: int, ffn: int, block_size: int, layers: int, group: int, seed: int,
                   ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    width, weights = 3, []
    for layer in range(layers):
        first = 4 * (layers * seed + layer)  # each projection its own weights
        weights += [1 + 0.1 * torch.randn(hidden, generator=gen),
                    *_q4((heads + 2 * kv_heads) * head_dim, hidden, group, first),
                    *_q4(hidden, heads * head_dim, group, first + 1),
                    1 + 0.1 * torch.randn(hidden, generator=gen),
                    *_q4(2 * ffn, hidden, group, first + 2),
                    *_q4(hidden, ffn, group, first + 3)]
    blocks = rows * width + 2
    shape = (blocks, kv_heads, block_size, head_dim)
    k_caches = [torch.randn(shape, generator=gen) for _ in range(layers)]
    v_caches = [torch.randn(shape, generator=gen) for _ in range(layers)]
    x = torch.randn(rows, hidden, generator=gen)
    angles = torch.rand(rows, head_dim, generator=gen) * 6
    tables = torch.randperm(blocks, generator=gen)[: rows * width].view(rows, width)
    lengths = torch.randint(1, width * block_size + 1, (rows,), generator=gen)
    positions = lengths - 1
    mask = torch.full((rows, width * block_size), float("-inf"))
    for row, length in enumerate(lengths.tolist()):
        mask[row, :length] = 0
    out = namespace.q4_decode_layers(
        x, angles.cos(), angles.sin(), tables[torch.arange(rows), positions // block_size],
        positions % block_size, tables, mask, k_caches, v_caches, weights, heads, kv_heads, 1e-5,
        1 / math.sqrt(head_dim), group, True)
    return out, k_caches, v_caches


def _q4(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, scale, zero = test_int8_dot._weights(n, k, group, seed)
    return int8_dot_layout.pack(values), int8_dot_layout.pack_scales(scale, zero)


if __name__ == "__main__":
    library_path, check = sys.argv[1:]
    real_ops = _use_stand_ins(library_path)
    if check == "decode_layers":
        _check_decode_layers(real_ops)
    else:
        {"attention": _check_attention, "q4": _check_q4, "bf16": _check_bf16}[check]()
    print(f"{check}:ok")
