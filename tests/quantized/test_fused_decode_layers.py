"""The decode step's layers in one C++ call (`fused_decode_layers.py`, `decode_layers.cpp`):
the same hidden states and cache writes as the model's own layers, run one by one, on a tiny
all-Q4_0 GGUF file loaded through the real loader; the compiled engine's decode logits as
the eager engine's; and only the models it covers take it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from backends.base import SamplingParams
from backends.cpu_kernels.build import active_variant
from backends.native.layers.attention import DecodeMetadata
from backends.native.llm_engine import LLMEngine
from backends.native.runner.compiled_step import _embed
from backends.native.runner.fused_decode_layers import FusedDecodeLayers
from tests.native.runner.fused_layer_checks import counted_fused_calls, decode_rows, random_caches
from tests.quantized.gguf_files import T, write_tiny_gguf
from tests.quantized.helpers import make_engine, native_greedy

pytestmark = pytest.mark.skipif(active_variant() is None, reason="our CPU kernels are not built")

BLOCK = 4
# Max |difference| between the fused layers and the layers one by one on this file (hidden
# states up to ~4 after two layers, random N(0, 1) caches): 1.8e-3 measured on AVX2. Not
# rounding alone: q4_mm quantizes each input block to int8 in two passes, so a last-ulp change
# of an input (the norm's sum in another order) can move a product by ~3e-5 of its block's
# largest value, and attention over these caches and the MLP amplify it (1e-7 relative noise
# on the MLP's input alone: 2.7e-5 out). A wrong rotation, mask or activation is off by ~1.
HIDDEN_TOLERANCE = 1e-2
# The compiled (fused) engine's decode logits against the eager engine's (logits ~1.6).
LOGIT_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def q4_engine(tmp_path_factory: pytest.TempPathFactory, default_gguf_path: str) -> LLMEngine:
    path = write_tiny_gguf(tmp_path_factory.mktemp("fused") / "tiny-q4_0.gguf",
                           default_gguf_path, lambda stem: T.Q4_0)
    return make_engine(path, dtype="float32", compile=True, block_size=BLOCK,
                       max_total_tokens=64)


@pytest.mark.parametrize("positions", [[6], [6, 13, 2]])
def test_fused_layers_match_the_layers_one_by_one(
    q4_engine: LLMEngine, positions: list[int],
) -> None:
    model = q4_engine.runner.model
    fused = q4_engine.runner.decode_step.fused_layers
    assert fused is not None, "an all-Q4_0 Llama in float32 is covered"
    tables = [[5, 2, 9, 0], [1, 7, 3, 11], [8, 4, 0, 0]][: len(positions)]
    rows = decode_rows(positions, tables, BLOCK)
    x, cos, sin, slot_blocks, slot_offsets, mask = _embed(model, rows, BLOCK)
    meta = DecodeMetadata(slot_blocks, slot_offsets, rows[:, 4:], mask)

    want_k, want_v = random_caches(q4_engine.runner.kv_cache, seed=1)
    want = x
    for layer, k, v in zip(model.model.layers, want_k, want_v, strict=True):
        want = layer(want, cos, sin, k, v, meta)

    got_k, got_v = random_caches(q4_engine.runner.kv_cache, seed=1)
    fused.k_caches, fused.v_caches = got_k, got_v
    try:
        got = fused(x, cos, sin, meta)
    finally:
        cache = q4_engine.runner.kv_cache
        fused.k_caches, fused.v_caches = list(cache.k), list(cache.v)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= HIDDEN_TOLERANCE
    assert want.abs().max().item() > 0.5  # the layers did something
    for i, (got_cache, want_cache) in enumerate(zip(got_k + got_v, want_k + want_v, strict=True)):
        first_layer = i % len(got_k) == 0  # its K/V come before any attention: rounding only
        tolerance = 1e-5 if first_layer else HIDDEN_TOLERANCE
        assert (got_cache - want_cache).abs().max().item() <= tolerance


def test_compiled_engine_decodes_through_the_fused_layers_as_eager(q4_engine: LLMEngine) -> None:
    prompt = list(range(300, 318))
    with counted_fused_calls(q4_engine.runner.decode_step) as calls:
        tokens, logits = native_greedy(q4_engine, prompt, steps=4)
    assert calls == [1, 1, 1]  # the three decode steps after the prompt's
    eager = make_engine(q4_engine.config.model, dtype="float32", compile=False,
                        block_size=BLOCK, max_total_tokens=64)
    eager_tokens, eager_logits = native_greedy(eager, prompt, steps=4)
    assert tokens == eager_tokens
    assert (logits - eager_logits).abs().max().item() <= LOGIT_TOLERANCE


def test_models_it_does_not_cover_keep_the_compiled_layers(
    q4_engine: LLMEngine, tiny_model: Callable[[str], Path], tmp_path: Path,
    default_gguf_path: str,
) -> None:
    dense = make_engine(tiny_model("llama_gqa"), dtype="float32", compile=True)
    assert FusedDecodeLayers.of(dense.runner.model, dense.runner.kv_cache) is None
    mixed = write_tiny_gguf(tmp_path / "mixed.gguf", default_gguf_path,
                            lambda stem: T.F16 if stem == "attn_output" else T.Q4_0)
    engine = make_engine(mixed, dtype="float32", compile=True)
    assert FusedDecodeLayers.of(engine.runner.model, engine.runner.kv_cache) is None
    bf16 = make_engine(q4_engine.config.model, dtype="bfloat16", compile=True)
    assert FusedDecodeLayers.of(bf16.runner.model, bf16.runner.kv_cache) is None
    assert FusedDecodeLayers.rows_fit(127) and not FusedDecodeLayers.rows_fit(128)


def test_new_batch_sizes_compile_nothing_once_warm(q4_engine: LLMEngine) -> None:
    """The fused layers' output feeds the logits region with a dynamic batch: a graph per
    batch size would recompile mid-serving (~1 s each) and, past the limit, decode eagerly."""
    q4_engine.warmup()
    step = q4_engine.runner.decode_step
    graphs = step.num_graphs
    for batch in (2, 5, 7):
        prompts = [list(range(200 + 9 * i, 206 + 9 * i)) for i in range(batch)]
        q4_engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0,
                                                   ignore_eos=True))
    assert step.num_graphs == graphs
    assert not step.broken
