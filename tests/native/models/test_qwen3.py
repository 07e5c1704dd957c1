"""Qwen3 (dense) in the native engine: greedy parity with transformers in float32 through the
safetensors folder and a GGUF of the same weights, on the compiled decode and prefill steps
with prepacked linears and the attention kernels; batched, prefix-cached, chunked and
preempted runs give the single runs' tokens; bf16 stays near the float32 logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from backends.native.layers.cpu_linear import PrepackedLinear
from backends.native.llm_engine import LLMEngine
from backends.native.loading.loader import load_checkpoint
from backends.native.loading.startup_cache import open_cache
from backends.native.models import sliding_window
from backends.native.models.qwen3 import Qwen3DecoderLayer
from backends.native.models.support import check_supported, layer_windows
from tests.native.models.tiny import TINY, VOCAB, write_qwen3_gguf, write_tiny
from tests.native.test_parity import (
    GREEDY,
    NEW_TOKENS,
    assert_all_blocks_free,
    make_engine,
    reference_greedy,
)
from tests.quantized.helpers import native_greedy

LENGTHS = (3, 17, 40, 9, 25, 61)
# Max |bf16 - float32| logit over the rows compared below (each prompt's last position, then
# the decode steps while the tokens agree: 18 rows), logits within +-1.2: 0.011 measured on
# AVX-512-BF16 with our bf16 linear kernel, 0.013 with oneDNN's, 0.014 without our attention
# kernels; about 5 bf16 steps (2^-7) at that magnitude.
BF16_TOLERANCE = 0.04


def qwen3_config(**overrides: object) -> transformers.Qwen3Config:
    """head_dim 32 beside hidden 64 / 4 heads (16): the explicit head_dim must be honoured."""
    options = {**TINY, "head_dim": 32, "tie_word_embeddings": True, **overrides}
    return transformers.Qwen3Config(**options)


def _norms_off_one(name: str, param: torch.nn.Parameter) -> None:
    """Per-head q / k norm weights away from 1, so that a missed or swapped norm shows."""
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        param.uniform_(0.3, 2.5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return write_tiny(tmp_path_factory.mktemp("qwen3"), tokenizer_dir, qwen3_config(),
                      tweak=_norms_off_one)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory, folder: Path,
              default_gguf_path: str) -> Path:
    return write_qwen3_gguf(tmp_path_factory.mktemp("qwen3-gguf") / "tiny-qwen3-f32.gguf",
                            folder, default_gguf_path)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def engine(folder: Path) -> LLMEngine:
    """float32 on the default (fast) path, shared: each engine compiles its own regions."""
    return make_engine(folder)


@pytest.fixture(scope="module")
def expected(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    return reference_greedy(folder, prompts, NEW_TOKENS)


def _tokens(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    seqs = engine.generate(prompts, GREEDY)
    assert all(s.finish_reason == "length" for s in seqs)
    return [s.output_token_ids for s in seqs]


def test_alone_and_batched_match_transformers_on_the_fast_path(
    engine: LLMEngine, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    layer = engine.loaded.model.model.layers[0]
    assert type(layer) is Qwen3DecoderLayer and layer.self_attn.head_dim == 32
    assert isinstance(layer.self_attn.qkv_proj, PrepackedLinear)  # our linear kernels
    assert layer.self_attn.cpu_kernel  # our attention kernels
    for prompt, want in zip(prompts[:2], expected[:2], strict=True):
        assert _tokens(engine, [prompt]) == [want]
    assert _tokens(engine, prompts) == expected
    assert_all_blocks_free(engine)
    decode, prefill = engine.runner.decode_step, engine.runner.prefill_step
    # float32 dense linears are not the C++ decode layers' (4-bit or bf16 kernel): the compiled
    # layer region, compiled once for batch 1 and once for a dynamic batch (beside embed and
    # logits).
    assert decode is not None and not decode.broken and decode.fused_layers is None
    assert decode.num_graphs == 6
    assert prefill is not None and not prefill.broken and prefill.num_graphs >= 2


def test_gguf_matches_transformers(
    gguf_file: Path, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    """Eager: the model is the folder's, only its loading differs (and compiling costs)."""
    engine = make_engine(gguf_file, compile=False)
    config = engine.loaded.hf_config
    assert config.model_type == "qwen3" and config.head_dim == 32 and config.tie_word_embeddings
    assert _tokens(engine, prompts) == expected
    assert_all_blocks_free(engine)


def test_gguf_config_survives_the_startup_cache(gguf_file: Path, tmp_path: Path) -> None:
    cache = open_cache(tmp_path, str(gguf_file))
    fresh = load_checkpoint(str(gguf_file), cache)
    cached = load_checkpoint(str(gguf_file), cache)
    assert cached.metadata_cached and type(cached.config) is transformers.Qwen3Config
    assert cached.config.to_dict() == fresh.config.to_dict()


def test_prefix_cache_hit_matches_transformers(
    engine: LLMEngine, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    """The same prompt twice: the second run reads its full blocks from the cache."""
    block_size = engine.block_manager.block_size
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    for _ in range(2):
        hits = engine.block_manager.hits
        assert _tokens(engine, [prompts[longest]]) == [expected[longest]]
    assert engine.block_manager.hits - hits >= len(prompts[longest]) // block_size
    engine.block_manager.check_integrity()


def test_chunked_prefill_under_preemption_matches_transformers(
    folder: Path, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    engine = make_engine(folder, max_total_tokens=96, max_batch_total_tokens=112, block_size=8,
                         max_batch_prefill_tokens=16)
    assert _tokens(engine, prompts) == expected
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_eager_path_matches_transformers(
    folder: Path, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    engine = make_engine(folder, compile=False, block_size=4)
    assert _tokens(engine, prompts) == expected


def test_bf16_logits_near_float32(
    folder: Path, engine: LLMEngine, prompts: list[list[int]],
) -> None:
    bf16 = make_engine(folder, dtype="bfloat16")
    # On an AVX-512-BF16 CPU the C++ bf16 decode layers run it (test_qwen3_fused.py).
    worst = 0.0
    for prompt in prompts[1:4]:
        want_tokens, want = native_greedy(engine, prompt, steps=6)
        got_tokens, got = native_greedy(bf16, prompt, steps=6)
        same = next((i for i, (a, b) in enumerate(zip(want_tokens, got_tokens, strict=True))
                     if a != b), len(want_tokens) - 1)
        # Row i was computed after the first i tokens: rows past a divergence differ in input.
        worst = max(worst, (got[:same + 1] - want[:same + 1]).abs().max().item())
    assert worst <= BF16_TOLERANCE, worst


def test_qwen3_sliding_window_from_max_window_layers() -> None:
    """The window covers the layers from max_window_layers on (test_sliding_window.py runs
    such a model); without use_sliding_window none."""
    assert sliding_window(qwen3_config(sliding_window=64)) is None  # not used without the flag
    windowed = qwen3_config(use_sliding_window=True, sliding_window=64, max_window_layers=1)
    check_supported(windowed)
    assert layer_windows(windowed) == [0, 64]
