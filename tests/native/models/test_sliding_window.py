"""Per-layer sliding windows: Qwen2 / Qwen3 with `use_sliding_window` slide only from layer
`max_window_layers` on (transformers' `layer_types`); the others attend fully. Greedy parity
with transformers in float32 at prompts longer than the window, on the compiled decode and
prefill steps, on the eager path, and chunked through SDPA's masks with prefix caching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from backends.native.llm_engine import LLMEngine
from backends.native.models import sliding_window
from backends.native.models.llama import LlamaDecoderLayer
from backends.native.models.support import check_supported, layer_windows
from tests.native.models.tiny import TINY, VOCAB, write_tiny
from tests.native.test_parity import (
    GREEDY,
    NEW_TOKENS,
    assert_all_blocks_free,
    make_engine,
    reference_greedy,
)

WINDOW = 16
LENGTHS = (40, 5, 67, 80, 23)


def qwen2_config(**overrides: object) -> transformers.Qwen2Config:
    """Three layers: the first attends fully, the other two slide."""
    options = {**TINY, "num_hidden_layers": 3, "use_sliding_window": True,
               "sliding_window": WINDOW, "max_window_layers": 1, **overrides}
    return transformers.Qwen2Config(**options)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return write_tiny(tmp_path_factory.mktemp("qwen2-window"), tokenizer_dir, qwen2_config())


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def expected(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    return reference_greedy(folder, prompts, NEW_TOKENS)


def _tokens(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    seqs = engine.generate(prompts, GREEDY)
    assert all(s.finish_reason == "length" for s in seqs)
    return [s.output_token_ids for s in seqs]


def test_windows_follow_transformers_layer_types() -> None:
    config = qwen2_config()
    check_supported(config)
    assert layer_windows(config) == [0, WINDOW, WINDOW] and sliding_window(config) == WINDOW
    assert layer_windows(qwen2_config(use_sliding_window=False)) == [0, 0, 0]
    assert sliding_window(qwen2_config(use_sliding_window=False)) is None
    qwen3 = transformers.Qwen3Config(**TINY, use_sliding_window=True, sliding_window=8,
                                     max_window_layers=1)
    check_supported(qwen3)
    assert layer_windows(qwen3) == [0, 8]
    typed = transformers.Qwen3Config(**TINY, use_sliding_window=True, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"])
    assert layer_windows(typed) == [8, 0]  # layer_types win over max_window_layers
    mistral = transformers.MistralConfig(**TINY, sliding_window=12)
    assert layer_windows(mistral) == [12, 12]  # one window over every layer


def test_fast_path_matches_transformers(
    folder: Path, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    engine = make_engine(folder)
    layers = engine.loaded.model.model.layers
    assert all(type(layer) is LlamaDecoderLayer for layer in layers)
    assert [layer.self_attn.window for layer in layers] == [0, WINDOW, WINDOW]
    assert layers[0].self_attn.cpu_kernel and engine.runner.mixed_windows
    assert _tokens(engine, prompts[:1]) == expected[:1]
    assert _tokens(engine, prompts) == expected
    decode = engine.runner.decode_step
    # The C++ decode layers take one mask for every layer: not these.
    assert decode is not None and not decode.broken and decode.fused_layers is None
    assert_all_blocks_free(engine)


def test_eager_path_matches_transformers(
    folder: Path, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    engine = make_engine(folder, compile=False, block_size=4)
    assert _tokens(engine, prompts) == expected


def test_chunked_prefill_with_prefix_caching_matches_transformers(
    folder: Path, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    """Chunks of 12 read their cached positions through SDPA's masks (no C++ attention) and
    the compiled decode attention's masks; the second round reads the prompts' full blocks
    from the prefix cache."""
    engine = make_engine(folder, attention_kernels=False, block_size=4,
                         max_batch_prefill_tokens=12)
    for _ in range(2):
        hits = engine.block_manager.hits
        assert _tokens(engine, prompts) == expected
    assert engine.block_manager.hits - hits >= sum(len(p) for p in prompts) // 4 - len(prompts)
    assert_all_blocks_free(engine)


def test_chunked_prefill_on_the_kernels_matches_transformers(
    folder: Path, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    """The same through our C++ prefill kernel, which takes each layer's window itself."""
    engine = make_engine(folder, block_size=8, max_batch_prefill_tokens=12,
                         compile_decode_step=False)
    assert engine.runner.kernel_prefill
    assert _tokens(engine, prompts) == expected
    assert _tokens(engine, prompts[2:3]) == expected[2:3]  # from the prefix cache
    assert_all_blocks_free(engine)
