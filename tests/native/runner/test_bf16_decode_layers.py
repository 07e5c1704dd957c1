"""A bf16 decode step's layers in one C++ call (`fused_decode_layers.Bf16DecodeLayers`,
cpu_kernels/bf16_decode_layers.cpp): the same hidden states and cache writes as the model's
own layers run one by one, to bf16 rounding; the compiled engine decodes through it with the
eager engine's logits; and only the models it covers take it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from backends.cpu_kernels.build import bf16_linear_built
from backends.native.layers.attention import DecodeMetadata
from backends.native.llm_engine import LLMEngine
from backends.native.runner.compiled_step import _embed
from backends.native.runner.fused_decode_layers import Bf16DecodeLayers, fused_decode_layers
from tests.native.runner.fused_layer_checks import counted_fused_calls, decode_rows, random_caches
from tests.quantized.helpers import make_engine, native_greedy


def _built() -> bool:  # bf16_linear_built() loads our kernels first
    return bf16_linear_built() and bool(torch.ops.switchyard_cpu.bf16_decode_layers_built())


pytestmark = pytest.mark.skipif(
    not _built(), reason="this CPU has no AVX-512-BF16 (or our kernels are off)")

BLOCK = 4
# Differences from the layers one by one come from rounding only: the fused layer rounds a
# rotated q / k once (eager rounds each product and the sum) and sums the norm's squares in
# another order, and the second layer carries those ulps on. Measured on the tiny model: one
# bf16 ulp of the largest hidden value (9.8e-4 of 0.19), of the written K / V likewise. A wrong
# rotation, mask, norm or residual is off by the values' own size.
RELATIVE_TOLERANCE = 2 ** -6  # four ulps of the largest value (bf16 keeps 8 bits)
# The first layer's K before any attention: a rounding apart, two ulps of the largest at most.
FIRST_K_TOLERANCE = 2 ** -7
# The compiled (fused) engine's decode logits against the eager engine's.
LOGIT_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def bf16_engine(tiny_model: Callable[[str], Path]) -> LLMEngine:
    return make_engine(tiny_model("llama_gqa"), compile=True, block_size=BLOCK,
                       max_total_tokens=64)


@pytest.mark.parametrize("positions", [[6], [6, 13, 2]])
def test_fused_layers_match_the_layers_one_by_one(
    bf16_engine: LLMEngine, positions: list[int],
) -> None:
    model = bf16_engine.runner.model
    fused = bf16_engine.runner.decode_step.fused_layers
    assert isinstance(fused, Bf16DecodeLayers), "a bf16 Llama on our bf16 kernel is covered"
    tables = [[5, 2, 9, 0], [1, 7, 3, 11], [8, 4, 0, 0]][: len(positions)]
    rows = decode_rows(positions, tables, BLOCK)
    with torch.inference_mode():
        x, cos, sin, slot_blocks, slot_offsets, mask = _embed(model, rows, BLOCK)
        meta = DecodeMetadata(slot_blocks, slot_offsets, rows[:, 4:], mask)
        want_k, want_v = random_caches(bf16_engine.runner.kv_cache, seed=1)
        want = x
        for layer, k, v in zip(model.model.layers, want_k, want_v, strict=True):
            want = layer(want, cos, sin, k, v, meta)
        got_k, got_v = random_caches(bf16_engine.runner.kv_cache, seed=1)
        fused.k_caches, fused.v_caches = got_k, got_v
        try:
            got = fused(x, cos, sin, meta)
        finally:
            cache = bf16_engine.runner.kv_cache
            fused.k_caches, fused.v_caches = list(cache.k), list(cache.v)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    largest = want.abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= RELATIVE_TOLERANCE * largest
    assert not torch.equal(want, x)  # the layers did something
    blocks, offsets = slot_blocks.tolist(), slot_offsets.tolist()
    for got_cache, want_cache in zip(got_k + got_v, want_k + want_v, strict=True):
        got_rows, want_rows = (c[blocks, :, offsets].float() for c in (got_cache, want_cache))
        assert (got_rows - want_rows).abs().max().item() <= \
            RELATIVE_TOLERANCE * want_rows.abs().max().item()
        untouched = torch.ones(got_cache.shape[:3], dtype=torch.bool)
        untouched[blocks, :, offsets] = False
        assert torch.equal(got_cache[untouched], want_cache[untouched])  # only each row's slot
    assert torch.equal(got_v[0], want_v[0])  # the first layer's v is copied as it is
    first_k = (got_k[0].float() - want_k[0].float()).abs()
    assert first_k.max().item() <= FIRST_K_TOLERANCE * want_k[0][blocks, :, offsets].abs().max()


def test_compiled_engine_decodes_through_the_fused_layers_as_eager(
    bf16_engine: LLMEngine,
) -> None:
    prompt = list(range(300, 318))
    with counted_fused_calls(bf16_engine.runner.decode_step) as calls:
        tokens, logits = native_greedy(bf16_engine, prompt, steps=4)
    assert calls == [1, 1, 1]  # the three decode steps after the prompt's
    eager = make_engine(bf16_engine.config.model, compile=False, block_size=BLOCK,
                        max_total_tokens=64)
    eager_tokens, eager_logits = native_greedy(eager, prompt, steps=4)
    assert tokens == eager_tokens
    assert (logits - eager_logits).abs().max().item() <= LOGIT_TOLERANCE


def test_models_it_does_not_cover_keep_the_compiled_layers(
    tiny_model: Callable[[str], Path],
) -> None:
    dense32 = make_engine(tiny_model("llama_gqa"), dtype="float32", compile=True)
    assert Bf16DecodeLayers.of(dense32.runner.model, dense32.runner.kv_cache) is None
    biased = make_engine(tiny_model("qwen2_bias_tied"), compile=True)  # q / k / v biases
    assert fused_decode_layers(biased.runner.model, biased.runner.kv_cache) is None
    assert biased.runner.decode_step.fused_layers is None
