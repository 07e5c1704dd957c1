"""Greedy parity with transformers (float32) for each supported architecture,
alone and batched, with chunked prefill and under KV pressure (preemption)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.llm_engine import LLMEngine
from tests.conftest import ARCHITECTURES

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts(count: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 40, 9, 25, 61, 5, 33][:count]
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]


def reference_greedy(path: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        )
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def make_engine(path: Path, **overrides) -> LLMEngine:
    options = {"dtype": "float32", "max_total_tokens": 256, "max_batch_total_tokens": 4096}
    options.update(overrides)
    return LLMEngine(EngineConfig(model=str(path), **options))


def assert_all_blocks_free(engine: LLMEngine) -> None:
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch_case(request, tiny_model: Callable[[str], Path]) -> tuple[Path, list, list]:
    path = tiny_model(request.param)
    prompts = _prompts(8)
    return path, prompts, reference_greedy(path, prompts, NEW_TOKENS)


def test_alone_matches_transformers(arch_case) -> None:
    path, prompts, expected = arch_case
    engine = make_engine(path)
    for prompt, want in zip(prompts[:3], expected[:3], strict=True):
        (seq,) = engine.generate([prompt], GREEDY)
        assert seq.output_token_ids == want
        assert seq.finish_reason == "length"
    assert_all_blocks_free(engine)


def test_eight_concurrent_match_transformers(arch_case) -> None:
    path, prompts, expected = arch_case
    engine = make_engine(path)
    seqs = engine.generate(prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == expected
    assert_all_blocks_free(engine)


def test_chunked_prefill_matches_transformers(arch_case) -> None:
    path, prompts, expected = arch_case
    engine = make_engine(path, max_batch_prefill_tokens=7, block_size=4)
    seqs = engine.generate(prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == expected
    assert_all_blocks_free(engine)


def test_preemption_keeps_outputs(arch_case) -> None:
    """KV capacity far below what 8 sequences need: all finish, outputs unchanged."""
    path, prompts, expected = arch_case
    engine = make_engine(path, max_total_tokens=96, max_batch_total_tokens=112, block_size=8)
    seqs = engine.generate(prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == expected
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_eager_decode_path_matches_transformers(arch_case) -> None:
    """The uncompiled decode attention (`compile=False`) gives the same tokens."""
    path, prompts, expected = arch_case
    engine = make_engine(path, compile=False, block_size=4)
    seqs = engine.generate(prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == expected
    assert_all_blocks_free(engine)
