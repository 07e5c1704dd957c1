"""Prepacked oneDNN linears: same outputs as F.linear, swapped in at load, traceable."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.cpu_linear import PrepackedLinear, can_prepack, prepack_linears
from backends.native.engine import LLMEngine
from backends.native.models.llama import FusedLinear
from backends.quantized.resident import resident_bytes

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)


def _linear(dtype: torch.dtype, bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(96, 160, bias=bias).to(dtype)


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_is_bit_identical_to_f_linear(rows: int, bias: bool) -> None:
    linear = _linear(torch.bfloat16, bias)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(PrepackedLinear(linear)(x), F.linear(x, linear.weight, linear.bias))


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_float32_matches_f_linear(rows: int) -> None:
    linear = _linear(torch.float32, bias=True)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got = PrepackedLinear(linear)(x)
    torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


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


def test_compiles_as_an_opaque_op() -> None:
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
        assert isinstance(layer.mlp.gate_up_proj, PrepackedLinear) == prepack
        outputs.append([s.output_token_ids for s in engine.generate(prompts, greedy)])
    assert outputs[0] == outputs[1]
