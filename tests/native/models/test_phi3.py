"""Phi-3 / Phi-4-mini in the native engine: checkpoint-fused qkv_proj / gate_up_proj, LongRoPE
(short and long factors, attention factor), partial rotary and a sliding window. Greedy parity
with transformers in float32 within `original_max_position_embeddings`, on the compiled steps
with prepacked linears; batched, prefix-cached, chunked and preempted runs give the single
runs' tokens; bf16 stays near float32; past the threshold, the per-position long factors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from backends.native.layers.cpu_linear import PrepackedLinear
from backends.native.llm_engine import LLMEngine
from backends.native.models import sliding_window
from backends.native.models.llama import LlamaDecoderLayer
from backends.native.models.phi3 import Phi3DecoderLayer
from backends.native.models.support import UnsupportedModelError, check_supported
from tests.native.models.tiny import TINY, VOCAB, write_phi3_gguf, write_tiny
from tests.native.test_parity import (
    GREEDY,
    NEW_TOKENS,
    assert_all_blocks_free,
    make_engine,
    reference_greedy,
)
from tests.quantized.helpers import native_greedy

THRESHOLD = 64  # original_max_position_embeddings; max_position_embeddings is 512
# Every prompt + NEW_TOKENS stays within THRESHOLD + 1 tokens: transformers' generate switches
# to the long factors (and recomputes its cache) only once its input exceeds THRESHOLD.
LENGTHS = (3, 17, 33, 9, 25, 30)
WINDOW = 20
# Max |bf16 - float32| logit over the rows compared below (18 rows): Qwen3's bound (0.011 to
# 0.014 measured there on the same shapes), about 5 bf16 steps (2^-7) at logits near +-1.2.
BF16_TOLERANCE = 0.04


def longrope(rotary_dim: int) -> dict[str, object]:
    """Factors away from 1 and from each other, so that a swapped or missed table shows."""
    half = rotary_dim // 2
    return {"rope_type": "longrope",
            "short_factor": [1.0 + 0.3 * i for i in range(half)],
            "long_factor": [2.0 + 1.7 * i for i in range(half)]}


def phi3_config(partial: float = 0.75, **overrides: object) -> transformers.Phi3Config:
    """head_dim 16; Phi-4-mini's 0.75 rotates 12 of its dims, 4 pass through."""
    options = {**TINY, "partial_rotary_factor": partial, "pad_token_id": 0,
               "original_max_position_embeddings": THRESHOLD, "sliding_window": WINDOW,
               "rope_scaling": longrope(int(16 * partial)), **overrides}
    return transformers.Phi3Config(**options)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return write_tiny(tmp_path_factory.mktemp("phi3"), tokenizer_dir, phi3_config())


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
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
    assert engine.loaded.sliding_window == WINDOW
    layer = engine.loaded.model.model.layers[0]
    assert type(layer) is Phi3DecoderLayer and layer.self_attn.rotary_dim == 12
    assert isinstance(layer.self_attn.qkv_proj, PrepackedLinear)  # our linear kernels
    assert layer.self_attn.cpu_kernel  # our attention kernels
    for prompt, want in zip(prompts[:2], expected[:2], strict=True):
        assert _tokens(engine, [prompt]) == [want]
    assert _tokens(engine, prompts) == expected
    assert_all_blocks_free(engine)
    decode, prefill = engine.runner.decode_step, engine.runner.prefill_step
    # Partial rotary is not Llama's layer: the compiled layer region, not the C++ layers.
    assert decode is not None and not decode.broken and decode.fused_layers is None
    assert prefill is not None and not prefill.broken and prefill.num_graphs >= 2


def test_gguf_matches_transformers(
    tmp_path: Path, folder: Path, default_gguf_path: str, prompts: list[list[int]],
    expected: list[list[int]],
) -> None:
    """llama.cpp's phi3 layout: fused attn_qkv / ffn_up, the factors as tensors. Eager: only
    the loading differs from the folder's model."""
    path = write_phi3_gguf(tmp_path / "tiny-phi3-f32.gguf", folder, default_gguf_path)
    engine = make_engine(path, compile=False)
    config = engine.loaded.hf_config
    assert config.model_type == "phi3" and engine.loaded.sliding_window == WINDOW
    assert config.rope_parameters["rope_type"] == "longrope"
    assert config.rope_parameters["partial_rotary_factor"] == 0.75
    assert _tokens(engine, prompts) == expected
    assert_all_blocks_free(engine)


def test_prefix_cache_hit_matches_transformers(
    engine: LLMEngine, prompts: list[list[int]], expected: list[list[int]],
) -> None:
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
    engine = make_engine(folder, compile=False, max_total_tokens=96,
                         max_batch_total_tokens=112, block_size=8, max_batch_prefill_tokens=16)
    assert _tokens(engine, prompts) == expected
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_bf16_logits_near_float32(
    folder: Path, engine: LLMEngine, prompts: list[list[int]],
) -> None:
    bf16 = make_engine(folder, dtype="bfloat16")
    worst = 0.0
    for prompt in prompts[1:4]:
        want_tokens, want = native_greedy(engine, prompt, steps=6)
        got_tokens, got = native_greedy(bf16, prompt, steps=6)
        same = next((i for i, (a, b) in enumerate(zip(want_tokens, got_tokens, strict=True))
                     if a != b), len(want_tokens) - 1)
        # Row i was computed after the first i tokens: rows past a divergence differ in input.
        worst = max(worst, (got[:same + 1] - want[:same + 1]).abs().max().item())
    assert worst <= BF16_TOLERANCE, worst


def _per_position_reference(folder: Path) -> transformers.Phi3ForCausalLM:
    """transformers' model with its rotary's short tables below THRESHOLD and long ones from
    there on (its own forward takes the long ones everywhere once a sequence passes it)."""
    model = transformers.Phi3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rotary = model.model.rotary_emb
    whole = rotary.forward

    def per_position(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cos_long, sin_long = whole(x, position_ids)
        cos_short, sin_short = whole(x, position_ids[:, :THRESHOLD])
        return (torch.cat((cos_short, cos_long[:, THRESHOLD:]), dim=1),
                torch.cat((sin_short, sin_long[:, THRESHOLD:]), dim=1))

    rotary.forward = per_position
    return model


@pytest.mark.parametrize("length", [56, 100])
def test_past_the_threshold_positions_take_the_long_factors(
    folder: Path, engine: LLMEngine, length: int,
) -> None:
    """A prompt crossing THRESHOLD during its decode (56 + 16) and one past it (100): each
    row's logits are those of transformers' full forward with per-position tables, not those
    of its whole-sequence switch to the long factors."""
    prompt = torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(3))
    tokens, got = native_greedy(engine, prompt.tolist(), steps=16)
    ids = torch.cat((prompt, torch.tensor(tokens[:-1])))[None]
    reference = _per_position_reference(folder)
    with torch.no_grad():
        per_position = reference(ids).logits[0]
        del reference.model.rotary_emb.forward  # transformers' own again
        all_long = reference(ids).logits[0]
    torch.testing.assert_close(got, per_position[length - 1:], rtol=0, atol=2e-4)
    # The two choices differ on this sequence by far more than the tolerance above (most below
    # the threshold: past it the sliding window sees long-factor positions only, either way).
    assert (all_long - per_position).abs().max() > 10 * 2e-4


def test_full_rotary_keeps_llamas_layer(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, prompts: list[list[int]],
) -> None:
    """Phi-3-mini's shape (every dim rotated, tied here): Llama's own layer, so the fused C++
    decode layers may take it; eager, compiling would cost a second model's graphs."""
    config = phi3_config(partial=1.0, tie_word_embeddings=True)
    folder = write_tiny(tmp_path_factory.mktemp("phi3-full"), tokenizer_dir, config)
    engine = make_engine(folder, compile=False)
    assert type(engine.loaded.model.model.layers[0]) is LlamaDecoderLayer
    assert _tokens(engine, prompts[:3]) == reference_greedy(folder, prompts[:3], NEW_TOKENS)


def test_support() -> None:
    check_supported(phi3_config())
    check_supported(phi3_config(rope_scaling=None))
    assert sliding_window(phi3_config()) == WINDOW
    assert sliding_window(phi3_config(sliding_window=None)) is None
    quantized = phi3_config(quantization_config={"quant_method": "bitsandbytes"})
    with pytest.raises(UnsupportedModelError, match="Pre-quantized Phi-3.*--backend transformers"):
        check_supported(quantized)
    llama = transformers.LlamaConfig(**TINY)
    llama.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match="'longrope'.*llama.*--backend transformers"):
        check_supported(llama)
