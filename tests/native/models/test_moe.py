"""Mixture-of-experts models (Qwen3-MoE with a dense layer, Mixtral, OLMoE) in the native
engine: greedy parity with transformers in float32 on the compiled decode and prefill steps
(the MoE block as one opaque operator inside them), batched, prefix-cached and preempted runs
equal to the single runs, the routing step bit-exact against transformers' router, a swapped
pair of experts or a flipped top-k normalisation breaking parity, bf16 near float32, and
GPTQ int4 experts near the dense model."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from backends.native.layers.cpu_linear import PrepackedLinear
from backends.native.llm_engine import LLMEngine
from backends.native.models.moe import SparseMoeBlock, moe_blocks
from backends.native.models.support import UnsupportedModelError, check_supported
from backends.quantized.int4_linear import Int4Linear
from tests.native.models.moe_tiny import (
    mixtral_config,
    moe_tweak,
    olmoe_config,
    qwen3_moe_config,
    write_gptq_int4,
)
from tests.native.models.tiny import VOCAB, write_tiny
from tests.native.test_parity import (
    GREEDY,
    assert_all_blocks_free,
    make_engine,
    reference_greedy,
)
from tests.quantized.helpers import native_greedy

CONFIGS: dict[str, Callable[..., PretrainedConfig]] = {
    "qwen3_moe": qwen3_moe_config, "mixtral": mixtral_config, "olmoe": olmoe_config}
LENGTHS = (3, 17, 40, 9, 25, 61)
NEW_TOKENS = 24
# Max |bf16 - float32| logit over each of 3 prompts' last position and 5 decode steps while the
# tokens agree (logits within +-0.85, where a bf16 step is 2^-8), on AVX-512-BF16 with our bf16
# linear kernel: eager 0.022 (Qwen3-MoE, OLMoE; Mixtral 0.013), compiled with our attention
# kernels 0.016-0.018. About 5 bf16 steps through 2 layers; a flipped expert choice moves
# logits by far more.
BF16_TOLERANCE = 0.05
# Max |int4 - dense| logit, same rows, the GPTQ checkpoint against its own rounded weights
# stored dense: 3.4e-4 measured (Qwen3-MoE; Mixtral 2.1e-4), the int4 kernel's float32 sums.
INT4_TOLERANCE = 2e-3


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def folder(arch: str, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return write_tiny(tmp_path_factory.mktemp(arch), tokenizer_dir, CONFIGS[arch](),
                      tweak=moe_tweak)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def expected(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    return reference_greedy(folder, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def engine(folder: Path) -> LLMEngine:
    """float32 on the default (compiled) path."""
    return make_engine(folder)


@pytest.fixture(scope="module")
def eager(folder: Path) -> LLMEngine:
    return make_engine(folder, compile=False)


def _tokens(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    seqs = engine.generate(prompts, replace(GREEDY, max_tokens=NEW_TOKENS))
    assert all(s.finish_reason == "length" for s in seqs)
    return [s.output_token_ids for s in seqs]


def test_alone_batched_and_prefix_cached_match_transformers_compiled(
    arch: str, engine: LLMEngine, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    blocks = list(moe_blocks(engine.loaded.model))
    assert len(blocks) == (1 if arch == "qwen3_moe" else 2)  # Qwen3-MoE: layer 0 dense
    assert isinstance(blocks[0].experts[0].gate_up_proj, PrepackedLinear)
    for prompt, want in zip(prompts[:2], expected[:2], strict=True):
        assert _tokens(engine, [prompt]) == [want]
    assert _tokens(engine, prompts) == expected
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    hits = engine.block_manager.hits
    assert _tokens(engine, [prompts[longest]]) == [expected[longest]]
    assert engine.block_manager.hits > hits
    assert_all_blocks_free(engine)
    decode, prefill = engine.runner.decode_step, engine.runner.prefill_step
    # Compiled, not fallen back to eager; the C++ decode layers decline MoE layers.
    assert decode is not None and not decode.broken and decode.fused_layers is None
    assert prefill is not None and not prefill.broken and prefill.num_graphs >= 2
    assert all(int(b.expert_tokens.sum()) > 0 for b in blocks)


def test_chunked_prefill_under_preemption_matches_transformers(
    folder: Path, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    """Eager: the compiled steps are the engine fixture's (a compile per block size costs)."""
    engine = make_engine(folder, max_total_tokens=96, max_batch_total_tokens=112, block_size=8,
                         max_batch_prefill_tokens=16, compile=False)
    assert _tokens(engine, prompts) == expected
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_routing_is_transformers_exactly(folder: Path, eager: LLMEngine) -> None:
    """The same hidden states through both routers: equal top-k indices and weights, bit for
    bit; the block's output within float32 rounding (prepacked expert matmuls)."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.randn(50, hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
    layer = len(hf.model.layers) - 1
    theirs = hf.model.layers[layer].mlp
    ours = eager.loaded.model.model.layers[layer].mlp
    assert isinstance(ours, SparseMoeBlock)
    with torch.no_grad():
        _, want_weights, want_indices = theirs.gate(x)
        weights, indices = ours.route(x)
        assert torch.equal(indices, want_indices) and torch.equal(weights, want_weights)
        torch.testing.assert_close(ours.route_and_run(x), theirs(x[None])[0],
                                   rtol=1e-5, atol=1e-6)


def test_expert_counts_and_state_dict(eager: LLMEngine, prompts: list[list[int]]) -> None:
    """An eager prefill routes every row through every layer: top-k counts per token."""
    model = eager.loaded.model
    blocks = list(moe_blocks(model))
    before = [b.expert_tokens.clone() for b in blocks]
    eager.generate([prompts[2]], replace(GREEDY, max_tokens=1))
    for block, old in zip(blocks, before, strict=True):
        assert int((block.expert_tokens - old).sum()) == block.top_k * len(prompts[2])
    assert not any(name.endswith("expert_tokens") for name in model.state_dict())


def test_swapped_experts_or_flipped_normalisation_break_parity(
    eager: LLMEngine, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    assert _tokens(eager, prompts[:3]) == expected[:3]
    blocks = list(moe_blocks(eager.loaded.model))
    _swap_experts(blocks)
    try:
        assert _tokens(eager, prompts[:3]) != expected[:3]
    finally:
        _swap_experts(blocks)
    for block in blocks:
        block.renormalize = not block.renormalize
    try:
        assert _tokens(eager, prompts[:3]) != expected[:3]
    finally:
        for block in blocks:
            block.renormalize = not block.renormalize
    assert _tokens(eager, prompts[:3]) == expected[:3]


def _swap_experts(blocks: list[SparseMoeBlock]) -> None:
    for block in blocks:
        experts = block.experts
        experts[0], experts[1] = experts[1], experts[0]


def _worst(engine: LLMEngine, other: LLMEngine, prompts: list[list[int]]) -> float:
    """Max |logit difference| over the rows computed from the same tokens."""
    worst = 0.0
    for prompt in prompts:
        want_tokens, want = native_greedy(engine, prompt, steps=6)
        got_tokens, got = native_greedy(other, prompt, steps=6)
        same = next((i for i, (a, b) in enumerate(zip(want_tokens, got_tokens, strict=True))
                     if a != b), len(want_tokens) - 1)
        worst = max(worst, (got[:same + 1] - want[:same + 1]).abs().max().item())
    return worst


def test_bf16_logits_near_float32(
    arch: str, folder: Path, eager: LLMEngine, prompts: list[list[int]],
) -> None:
    """Qwen3-MoE compiled: its layers are Qwen3's but for the MLP, and on an AVX-512-BF16 CPU
    the C++ bf16 decode layers run Qwen3's; they must decline these (the compiled layer
    region runs them). The other two eager, for the compile time."""
    bf16 = make_engine(folder, dtype="bfloat16", compile=arch == "qwen3_moe")
    worst = _worst(eager, bf16, prompts[1:4])
    assert worst <= BF16_TOLERANCE, worst
    decode = bf16.runner.decode_step
    assert decode is None or (not decode.broken and decode.fused_layers is None)


def test_int4_experts_match_their_dequantized_weights(
    arch: str, folder: Path, prompts: list[list[int]], tmp_path: Path,
) -> None:
    """GPTQ int4 through the in-tree int4 loader against the same rounded weights dense."""
    if arch == "olmoe":  # its experts are named as Qwen3-MoE's
        pytest.skip("one int4 case per checkpoint naming: mlp.experts, block_sparse_moe")
    int4 = make_engine(write_gptq_int4(folder, tmp_path / "gptq"), compile=False)
    dense = make_engine(write_gptq_int4(folder, tmp_path / "dense", dequantized=True),
                        compile=False)
    for block in moe_blocks(int4.loaded.model):
        assert all(type(e.gate_up_proj) is Int4Linear and type(e.down_proj) is Int4Linear
                   for e in block.experts)
        assert type(block.gate).__name__ == "Router"  # the router stays dense
    assert "gptq 4-bit" in int4.loaded.quantization
    worst = _worst(dense, int4, prompts[1:4])
    assert worst <= INT4_TOLERANCE, worst


def test_clip_qkv_matches_transformers(
    tmp_path: Path, tokenizer_dir: Path, prompts: list[list[int]],
) -> None:
    """OLMoE's clip_qkv, low enough that the clamp bites."""
    folder = write_tiny(tmp_path / "clip", tokenizer_dir, olmoe_config(clip_qkv=0.05),
                        tweak=moe_tweak)
    engine = make_engine(folder, compile=False)
    assert _tokens(engine, prompts[:3]) == reference_greedy(folder, prompts[:3], NEW_TOKENS)


@pytest.mark.parametrize(("config", "fragment"), [
    (lambda: qwen3_moe_config(shared_expert_intermediate_size=64),
     "shared_expert_intermediate_size"),
    (lambda: mixtral_config(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (lambda: PretrainedConfig.from_dict({"model_type": "qwen2_moe"}), "'qwen2_moe'"),
])
def test_unsupported_moe_configs_are_refused(config, fragment: str) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        check_supported(config())
    assert fragment in str(info.value) and "--backend transformers" in str(info.value)


def test_shared_experts_refused_at_load(tmp_path: Path, tokenizer_dir: Path) -> None:
    folder = write_tiny(tmp_path / "shared", tokenizer_dir, qwen3_moe_config())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_shared_experts": 1}))
    with pytest.raises(UnsupportedModelError, match="n_shared_experts"):
        make_engine(folder)
    shutil.rmtree(folder)
