"""Gemma 3 (text) in the native engine: greedy parity with transformers' Gemma3ForCausalLM in
float32 through the safetensors folder and a GGUF of the same weights (norms stored plus 1),
on the compiled decode and prefill steps with prepacked linears and the attention kernels and
on the eager path; prompts longer than the local layers' window, chunked, batched,
prefix-cached and preempted; bf16 near float32; a 262144-token vocabulary through the greedy
head; generation_config's end-of-turn id stops a request."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from backends.base import SamplingParams
from backends.native.layers.cpu_linear import PrepackedLinear
from backends.native.llm_engine import LLMEngine
from backends.native.loading.loader import load_checkpoint
from backends.native.loading.startup_cache import open_cache
from backends.native.models.gemma3 import Gemma3DecoderLayer
from backends.native.models.support import (
    UnsupportedModelError,
    check_supported,
    layer_windows,
)
from tests.native.models.tiny import TINY, VOCAB, write_gemma3_gguf, write_tiny
from tests.native.test_parity import (
    GREEDY,
    NEW_TOKENS,
    assert_all_blocks_free,
    make_engine,
    reference_greedy,
)
from tests.quantized.helpers import native_greedy

WINDOW = 16  # the local layers'; most prompts (and all generations) run past it
LENGTHS = (3, 17, 40, 9, 61, 80)
BIG_VOCAB = 262144  # Gemma 3's own
# Max |bf16 - float32| logit over the rows compared (18 rows): measured 0.057 with our bf16
# linear and attention kernels on AVX-512-BF16 (six layers of four norms each, the embeddings
# scaled by 8), about 7 bf16 steps (2^-7) at logits near +-1.5.
BF16_TOLERANCE = 0.08


def gemma3_config(**overrides: object) -> transformers.Gemma3TextConfig:
    """Six layers, Gemma 3's pattern (five local, then one global); Gemma 3's rotary bases
    (10000 local, as llama.cpp assumes: its converter writes only the global one) and linear
    scaling on the global layers only, so that a swapped or missed one shows. The attention
    scalar is head_dim, as llama.cpp derives it (a GGUF file does not carry it); the eager
    test runs another."""
    options = {
        **TINY, "num_hidden_layers": 6, "head_dim": 32, "query_pre_attn_scalar": 32,
        "sliding_window": WINDOW, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "eos_token_id": [1, 106], "bos_token_id": 2, "pad_token_id": 0, **overrides,
    }
    return transformers.Gemma3TextConfig(**options)


def _norms_off_zero(name: str, param: torch.nn.Parameter) -> None:
    """Norm weights (zero-centred in Gemma) away from 0, so that a missed `1 +` shows."""
    if name.endswith("norm.weight"):
        param.uniform_(-0.7, 1.5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return write_tiny(tmp_path_factory.mktemp("gemma3"), tokenizer_dir, gemma3_config(),
                      tweak=_norms_off_zero)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory, folder: Path,
              default_gguf_path: str) -> Path:
    return write_gemma3_gguf(tmp_path_factory.mktemp("gemma3-gguf") / "tiny-gemma3-f32.gguf",
                             folder, default_gguf_path)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
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


def test_layers_follow_the_config() -> None:
    config = gemma3_config()
    check_supported(config)
    assert layer_windows(config) == [WINDOW] * 5 + [0]
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert config.rope_parameters["full_attention"]["factor"] == 4.0


def test_alone_and_batched_match_transformers_on_the_fast_path(
    engine: LLMEngine, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    layers = engine.loaded.model.model.layers
    assert all(type(layer) is Gemma3DecoderLayer for layer in layers)
    assert [layer.self_attn.window for layer in layers] == [WINDOW] * 5 + [0]
    assert [layer.self_attn.rope_table for layer in layers] == [1] * 5 + [0]
    assert isinstance(layers[0].self_attn.qkv_proj, PrepackedLinear)  # our linear kernels
    assert layers[0].self_attn.cpu_kernel  # our attention kernels
    assert engine.loaded.sliding_window == WINDOW and engine.runner.mixed_windows
    for prompt, want in zip(prompts[:2], expected[:2], strict=True):
        assert _tokens(engine, [prompt]) == [want]
    assert _tokens(engine, prompts) == expected
    assert_all_blocks_free(engine)
    decode, prefill = engine.runner.decode_step, engine.runner.prefill_step
    # Local and global layers run graphs of their own (window, rotary table), each for
    # batch 1 and a dynamic batch, beside the embedding and logits regions.
    assert decode is not None and not decode.broken and decode.fused_layers is None
    assert decode.num_graphs == 8
    assert prefill is not None and not prefill.broken and prefill.num_graphs >= 2


def test_eager_path_and_query_pre_attn_scalar_match_transformers(
    tmp_path: Path, tokenizer_dir: Path, prompts: list[list[int]],
) -> None:
    """No compiled regions nor C++ attention (the SDPA masks and spans of each layer), on a
    model whose attention scale is not head_dim ** -0.5."""
    folder = write_tiny(tmp_path, tokenizer_dir, gemma3_config(query_pre_attn_scalar=24),
                        tweak=_norms_off_zero)
    engine = make_engine(folder, compile=False, block_size=4)
    assert engine.loaded.model.model.layers[0].self_attn.scale == 24**-0.5
    assert _tokens(engine, prompts) == reference_greedy(folder, prompts, NEW_TOKENS)


def test_gguf_matches_transformers(
    gguf_file: Path, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    """Eager: the model is the folder's, only its loading differs (and compiling costs)."""
    engine = make_engine(gguf_file, compile=False)
    config = engine.loaded.hf_config
    assert config.model_type == "gemma3_text" and config.tie_word_embeddings
    assert layer_windows(config) == [WINDOW] * 5 + [0]
    assert config.query_pre_attn_scalar == 32  # llama.cpp's: head_dim (the file has no other)
    assert _tokens(engine, prompts) == expected
    assert_all_blocks_free(engine)


def test_gguf_config_survives_the_startup_cache(gguf_file: Path, tmp_path: Path) -> None:
    cache = open_cache(tmp_path, str(gguf_file))
    fresh = load_checkpoint(str(gguf_file), cache)
    cached = load_checkpoint(str(gguf_file), cache)
    assert cached.metadata_cached and type(cached.config) is transformers.Gemma3TextConfig
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
    # Every full block but one holding the last prompt token (its logits are computed)
    assert engine.block_manager.hits - hits >= (len(prompts[longest]) - 1) // block_size
    engine.block_manager.check_integrity()


def test_chunked_prefill_under_preemption_matches_transformers(
    folder: Path, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    engine = make_engine(folder, max_total_tokens=128, max_batch_total_tokens=144, block_size=8,
                         max_batch_prefill_tokens=16)
    assert _tokens(engine, prompts) == expected
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_chunked_prefill_with_prefix_caching_on_the_torch_attention(
    folder: Path, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    """Chunks that read cached positions through SDPA's masks (no C++ attention), the window
    cutting into them, then the same prompts again from the prefix cache."""
    engine = make_engine(folder, attention_kernels=False, block_size=4,
                         max_batch_prefill_tokens=12)
    assert not engine.runner.kernel_prefill
    for _ in range(2):
        assert _tokens(engine, prompts[3:]) == expected[3:]
    assert engine.block_manager.hits > 0
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


def test_generation_config_end_of_turn_stops(
    folder: Path, tmp_path: Path, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    """Gemma's <end_of_turn> is an eos id of generation_config.json beside the config's: a
    token the model emits, declared there, ends the request."""
    stop_at = 5
    stop_token = expected[1][stop_at]
    if stop_token in expected[1][:stop_at]:
        pytest.skip("the chosen token comes earlier too")
    copy = tmp_path / "gemma3-eot"
    shutil.copytree(folder, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, stop_token]}))
    engine = make_engine(copy, compile=False)
    (seq,) = engine.generate([prompts[1]], SamplingParams(max_tokens=NEW_TOKENS,
                                                           temperature=0.0))
    assert seq.finish_reason == "stop"
    assert seq.output_token_ids == expected[1][:stop_at + 1]


def test_refusals() -> None:
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        with pytest.raises(UnsupportedModelError, match=f"{name}.*--backend transformers"):
            check_supported(gemma3_config(**{name: 30.0}))
    with pytest.raises(UnsupportedModelError, match="gemma3.*--backend transformers"):
        check_supported(transformers.Gemma3Config(text_config=gemma3_config().to_dict()))
    with pytest.raises(UnsupportedModelError, match="hidden_act 'silu'.*gemma3_text"):
        check_supported(gemma3_config(hidden_activation="silu"))
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu_pytorch_tanh'"):
        check_supported(transformers.LlamaConfig(hidden_act="gelu_pytorch_tanh"))


def test_a_262k_vocabulary_matches_transformers_and_the_greedy_head(
    tmp_path: Path, tokenizer_dir: Path, prompts: list[list[int]],
) -> None:
    """Gemma 3's vocabulary size: float32 logits equal transformers' tokens; in bf16 the
    greedy head's tokens (a 262144 x 64 int8 pass) are the full lm_head's argmax."""
    config = gemma3_config(vocab_size=BIG_VOCAB, num_hidden_layers=2,
                           layer_types=["sliding_attention", "full_attention"])
    folder = write_tiny(tmp_path, tokenizer_dir, config, tweak=_norms_off_zero)
    short = [prompt[:20] for prompt in prompts[:3]]
    f32 = make_engine(folder, compile=False)
    assert _tokens(f32, short) == reference_greedy(folder, short, NEW_TOKENS)
    bf16 = make_engine(folder, dtype="bfloat16")
    head = bf16.runner.decode_step.greedy_head
    if head is None:
        pytest.skip("no bf16 lm_head kernel on this CPU: no greedy head")
    assert head.rows.shape == (BIG_VOCAB, 64)
    decided = []
    tokens_of = head.tokens

    def counted(hidden: torch.Tensor) -> torch.Tensor | None:
        tokens = tokens_of(hidden)
        decided.append(tokens is not None)
        return tokens

    head.tokens = counted  # type: ignore[method-assign]
    for prompt in short:
        decided.clear()
        (seq,) = bf16.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                         ignore_eos=True))
        assert sum(decided) >= 6, "the head never decided a step"
        full_tokens, _ = native_greedy(bf16, prompt, steps=8)  # through the whole lm_head
        assert seq.output_token_ids == full_tokens
