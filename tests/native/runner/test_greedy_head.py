"""The greedy head (greedy_head.py, cpu_kernels/greedy_head.cpp): each row's token is the
argmax of the logits our bf16 linear gives, ties and flat logits included, and the engine's
tokens are the same with it on and off."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.base import SamplingParams
from backends.cpu_kernels.build import bf16_linear_built
from backends.native.config import EngineConfig
from backends.native.layers.cpu_linear import pack_for_bf16_kernel
from backends.native.llm_engine import LLMEngine
from backends.native.runner.greedy_head import GreedyHead, unpack_bf16_kernel_weight


def _head_built() -> bool:
    return bf16_linear_built() and bool(torch.ops.switchyard_cpu.greedy_head_built())


VOCAB = 49152  # the tiny models' (tests/conftest.py)

pytestmark = pytest.mark.skipif(
    not _head_built(), reason="this CPU has no AVX-512-BF16 (or our kernels are off): no bf16 "
    "lm_head kernel, so no greedy head")


def _full_argmax(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bf16_linear's logits' argmax (its columns padded to 16 with zero rows, then cut)."""
    vocab = weight.shape[0]
    padded = torch.zeros(-(-vocab // 16) * 16, weight.shape[1], dtype=weight.dtype)
    padded[:vocab] = weight
    logits = torch.ops.switchyard_cpu.bf16_linear(x, pack_for_bf16_kernel(padded), None)
    return logits[:, :vocab].float().argmax(dim=-1)


def _flat_weight(vocab: int, features: int, seed: int) -> torch.Tensor:
    """Random rows at a small scale (flat logits: many tokens within the int8 bound), some
    duplicated (exact ties: the lowest index must win)."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, features, generator=gen) * 0.02).to(torch.bfloat16)
    weight[vocab - 1] = weight[3]
    weight[vocab // 2] = weight[3]
    weight[vocab - 2] = weight[vocab - 5]
    return weight


@pytest.mark.parametrize(("vocab", "features"), [(16, 4), (1000, 64), (4099, 96), (8000, 768)])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 33])
def test_tokens_are_the_full_logits_argmax(vocab: int, features: int, rows: int) -> None:
    weight = _flat_weight(vocab, features, seed=vocab + rows)
    head = GreedyHead(weight)
    gen = torch.Generator().manual_seed(rows)
    for trial in range(6):
        x = torch.randn(rows, features, generator=gen)
        if trial == 1:  # aimed at the duplicated rows: a tie for the top
            x[0] = weight[3].float() * 50
            x[-1] = weight[vocab - 5].float() * 50
        if trial == 2:
            x = x * 1e-3
        x = x.to(torch.bfloat16)
        got = head.tokens(x)
        assert got is not None, f"trial {trial}: a row left undecided"
        assert torch.equal(got, _full_argmax(x, weight)), f"trial {trial}"


def test_a_tie_goes_to_the_lowest_index() -> None:
    weight = _flat_weight(512, 64, seed=1)
    x = (weight[3].float() * 100).to(torch.bfloat16)[None]
    assert GreedyHead(weight).tokens(x).tolist() == [3]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0])
def test_a_row_it_cannot_bound_asks_for_the_logits(bad: float) -> None:
    head = GreedyHead(_flat_weight(256, 32, seed=2))
    x = torch.randn(3, 32).to(torch.bfloat16)
    if bad == 0.0:
        x[1] = 0.0
    else:
        x[1, 5] = bad
    assert head.tokens(x) is None


def test_unpacking_gives_back_the_weight() -> None:
    weight = _flat_weight(64, 32, seed=3)
    assert torch.equal(unpack_bf16_kernel_weight(pack_for_bf16_kernel(weight)), weight)


def _engine(path: Path, **overrides: Any) -> LLMEngine:
    options = {"dtype": "bfloat16", "max_total_tokens": 256, "max_batch_total_tokens": 4096,
               "block_size": 4, **overrides}
    return LLMEngine(EngineConfig(model=str(path), **options))


def _requests(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    gen = torch.Generator().manual_seed(5)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [(torch.randint(3, vocab, (n,), generator=gen).tolist(), greedy)
                for n in (3, 17, 40, 9, 25, 61, 5, 33)]
    # Rows that need the logits, beside plain greedy ones in some steps: the full path then.
    requests[2] = (requests[2][0], SamplingParams(max_tokens=6, temperature=0.0, logprobs=True,
                                                  ignore_eos=True))
    requests[5] = (requests[5][0], SamplingParams(max_tokens=4, temperature=0.8, seed=7,
                                                  ignore_eos=True))
    return requests


def _tokens(engine: LLMEngine, vocab: int) -> list[list[int]]:
    prompts, params = zip(*_requests(vocab), strict=True)
    return [s.output_token_ids for s in engine.generate(list(prompts), list(params))]


def test_engine_tokens_match_with_the_head_off(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama_gqa")
    with_head = _engine(path)
    head = with_head.runner.decode_step.greedy_head
    assert head is not None and with_head.runner.prefill_step.greedy_head is head
    calls = {"decided": 0}
    tokens_of = head.tokens

    def counted(hidden: torch.Tensor) -> torch.Tensor | None:
        tokens = tokens_of(hidden)
        calls["decided"] += tokens is not None
        return tokens

    head.tokens = counted  # type: ignore[method-assign]
    got = _tokens(with_head, VOCAB)
    assert calls["decided"] >= 6, "the head never decided a step"
    without = _engine(path, greedy_head=False)
    assert without.runner.decode_step.greedy_head is None
    assert got == _tokens(without, VOCAB)
    # What /info reports beside the weights: int8 copy, stats and the bf16 rows.
    vocab, features = head.rows.shape
    assert with_head.runner.greedy_head_bytes == head.packed.numel() + head.stats.nbytes \
        + vocab * features * 2 > 0
    assert without.runner.greedy_head_bytes == 0


def test_a_tied_head_keeps_the_embedding_table_as_its_rows(
    tiny_model: Callable[[str], Path],
) -> None:
    """No second row-major copy where the lm_head is the embedding table; same tokens."""
    path = tiny_model("qwen2_bias_tied")
    with_head = _engine(path)
    head = with_head.runner.decode_step.greedy_head
    assert head is not None
    assert head.rows.data_ptr() == with_head.runner.model.model.embed_tokens.weight.data_ptr()
    assert with_head.runner.greedy_head_bytes == head.packed.nbytes + head.stats.nbytes
    assert _tokens(with_head, VOCAB) == _tokens(_engine(path, greedy_head=False), VOCAB)
