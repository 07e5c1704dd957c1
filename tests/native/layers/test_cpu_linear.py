"""Prepacked oneDNN linears: same outputs as F.linear, swapped in at load, traceable."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends.base import SamplingParams
from backends.cpu_kernels.build import active_variant
from backends.native.config import EngineConfig
from backends.native.layers import cpu_linear
from backends.native.layers.cpu_linear import (
    PrepackedLinear,
    can_prepack,
    prepack_linears,
    row_bucket,
)
from backends.native.llm_engine import LLMEngine
from backends.native.models.llama import FusedLinear
from backends.quantized.resident import resident_bytes

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)
BF16_PACKABLE = can_prepack(torch.device("cpu"), torch.bfloat16)
needs_bf16 = pytest.mark.skipif(
    not BF16_PACKABLE, reason="this CPU's oneDNN has no bf16 path (AVX2 only): bf16 linears "
    "stay plain F.linear, as test_engine_tokens_do_not_change checks")


@pytest.fixture(params=["python", "c++"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """PrepackedLinears made in the test call this file's Python op or our C++ one."""
    if request.param == "python":
        monkeypatch.setattr(cpu_linear, "active_variant", lambda: None)
    elif active_variant() is None:
        pytest.skip("our C++ kernels are not built for this CPU")
    return request.param


def _linear(dtype: torch.dtype, bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(96, 160, bias=bias).to(dtype)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 5, 17, 64, 100, 333])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_is_bit_identical_to_f_linear(rows: int, bias: bool, implementation: str) -> None:
    linear = _linear(torch.bfloat16, bias)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        packed = PrepackedLinear(linear)
        assert packed.native == (implementation == "c++")
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))


@pytest.mark.parametrize("rows", [1, 7, 64, 333])
def test_float32_matches_f_linear(rows: int, implementation: str) -> None:
    linear = _linear(torch.float32, bias=True)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got = PrepackedLinear(linear)(x)
    torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


@needs_bf16
def test_three_dimensional_input_keeps_its_shape(implementation: str) -> None:
    linear = _linear(torch.bfloat16, bias=True)
    x = torch.randn(3, 7, 96, dtype=torch.bfloat16)  # 21 rows: padded to 22 inside
    with torch.inference_mode():
        got = PrepackedLinear(linear)(x)
    assert got.shape == (3, 7, 160)
    assert torch.equal(got, F.linear(x, linear.weight, linear.bias))


def test_row_buckets_are_few_and_waste_little() -> None:
    buckets = [row_bucket(rows) for rows in range(1, 4097)]
    assert buckets[:16] == list(range(1, 17))  # decode batches run exactly
    assert all(b >= rows for rows, b in enumerate(buckets, 1))
    assert buckets == sorted(buckets)
    assert max((b - rows) / rows for rows, b in enumerate(buckets, 1)) < 0.125
    assert len(set(buckets[:2048])) == 72 and len(set(buckets)) == 80


def test_onednn_sees_only_bucketed_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python op's calls (the C++ op's bucketing shows in the memory test below)."""
    monkeypatch.setattr(cpu_linear, "active_variant", lambda: None)
    seen: set[int] = set()
    call = cpu_linear._call_onednn

    def record(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               ) -> torch.Tensor:
        seen.add(rows.shape[0])
        return call(rows, weight, bias)

    monkeypatch.setattr(cpu_linear, "_call_onednn", record)
    packed = PrepackedLinear(_linear(torch.float32, bias=False))
    with torch.inference_mode():
        for rows in range(1, 600):
            packed(torch.randn(rows, 96))
    assert seen == {row_bucket(rows) for rows in range(1, 600)} and len(seen) == 58


_GROWTH_SCRIPT = """
import torch
from backends.native.layers.cpu_linear import PrepackedLinear
torch.set_num_threads(1)
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
packed = PrepackedLinear(torch.nn.Linear(576, 1536, bias=False))
x = torch.randn(700, 576)
with torch.inference_mode():
    packed(x[:1])
    start = rss()
    for rows in range(1, 700):
        packed(x[:rows])
print((rss() - start) / 1024)
"""


def test_many_row_counts_do_not_grow_memory_without_bound() -> None:
    """oneDNN keeps ~0.6 MiB or more per row count it has seen: 699 distinct counts took
    ~400 MiB before bucketing; bucketed they are 59 counts. The C++ op where it is built."""
    run = subprocess.run([sys.executable, "-c", _GROWTH_SCRIPT], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[3])
    grown_mib = float(run.stdout.strip().splitlines()[-1])
    assert grown_mib < 120, f"RSS grew {grown_mib:.0f} MiB over 699 row counts"


def test_the_cpp_op_refuses_an_unknown_handle() -> None:
    if active_variant() is None:
        pytest.skip("our C++ kernels are not built for this CPU")
    with pytest.raises(RuntimeError, match="no packed weight 123456"):
        torch.ops.switchyard_cpu.prepacked_linear(torch.randn(2, 8), torch.tensor(123456), 4,
                                                  None)


def test_wrong_input_dtype_is_refused() -> None:
    packed = PrepackedLinear(_linear(torch.float32, bias=False))
    with pytest.raises(TypeError, match="float32 weights"):
        packed(torch.randn(2, 96, dtype=torch.bfloat16))


def test_prepack_swaps_dense_linears_and_keeps_shards() -> None:
    model = nn.Sequential(FusedLinear(32, [16, 8, 8], bias=False), nn.ReLU(), nn.Linear(32, 4))
    model.eval()
    nn.init.normal_(model[0].weight)
    x = torch.randn(3, 32)
    with torch.inference_mode():
        before = model(x)
        assert prepack_linears(model) == 2
        after = model(x)
    assert isinstance(model[0], PrepackedLinear) and model[0].shards == [16, 8, 8]
    assert isinstance(model[2], PrepackedLinear)
    assert not any(m.training for m in model.modules())  # bitsandbytes' CPU path needs eval
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert resident_bytes(model) == (32 * 32 + 4 * 32 + 4) * 4  # packed weights still count


@needs_bf16
def test_compiles_as_an_opaque_op(implementation: str) -> None:
    linear = _linear(torch.bfloat16, bias=True)
    packed = PrepackedLinear(linear)
    compiled = torch.compile(lambda x: torch.relu(packed(x)), dynamic=True, fullgraph=True)
    x = torch.randn(9, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(compiled(x), torch.relu(F.linear(x, linear.weight, linear.bias)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_do_not_change(tiny_model: Callable[[str], Path], dtype: str) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13]]
    outputs = []
    for prepack in (False, True):
        path = tiny_model("llama_gqa")
        engine = LLMEngine(EngineConfig(model=str(path), dtype=dtype, compile=False,
                                        prepack_weights=prepack, max_total_tokens=128))
        layer = engine.loaded.model.model.layers[0]
        packable = dtype == "float32" or BF16_PACKABLE  # else: plain, and still loads
        assert isinstance(layer.mlp.gate_up_proj, PrepackedLinear) == (prepack and packable)
        outputs.append([s.output_token_ids for s in engine.generate(prompts, greedy)])
    assert outputs[0] == outputs[1]
