"""Prefix cache: hits are token-identical to cold runs; unchunked scheduling (TGI's knobs)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from backends.base import SamplingParams
from tests.native.test_parity import (
    GREEDY,
    assert_all_blocks_free,
    make_engine,
    reference_greedy,
)


def _shared_prefix_prompts(count: int, prefix_len: int = 45) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 49152, (prefix_len,), generator=gen).tolist()
    return [prefix + torch.randint(3, 49152, (5 + i,), generator=gen).tolist()
            for i in range(count)]


def _all_free_or_evictable(engine) -> None:
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_hits_are_identical_to_cold_runs(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama_gqa")
    prompts = _shared_prefix_prompts(4)
    expected = reference_greedy(path, prompts, 32)
    cold = make_engine(path, prefix_caching=False, block_size=8)
    assert [s.output_token_ids for s in cold.generate(prompts, GREEDY)] == expected
    assert cold.block_manager.hits == 0

    warm = make_engine(path, block_size=8)
    (first,) = warm.generate(prompts[:1], GREEDY)  # fills the cache
    assert first.output_token_ids == expected[0]
    hits_before = warm.block_manager.hits
    later = warm.generate(prompts[1:], GREEDY)
    assert [s.output_token_ids for s in later] == expected[1:]
    assert warm.block_manager.hits - hits_before >= 3 * (45 // 8)
    assert warm.block_manager.num_evictable_blocks > 0
    _all_free_or_evictable(warm)


def test_each_sequence_reports_its_own_first_hit(tiny_model: Callable[[str], Path]) -> None:
    """`cached_tokens`: the full blocks found cached when a sequence was first scheduled (0 on
    a miss); a recompute after preemption finds its own blocks again and does not count."""
    path = tiny_model("llama_gqa")
    engine = make_engine(path, block_size=8, compile=False)
    first, *later = _shared_prefix_prompts(3)
    (cold,) = engine.generate([first], GREEDY)
    assert cold.cached_tokens == 0
    assert [s.cached_tokens for s in engine.generate(later, GREEDY)] == [45 // 8 * 8] * 2

    gen = torch.Generator().manual_seed(5)
    distinct = [torch.randint(3, 49152, (40,), generator=gen).tolist() for _ in range(6)]
    tight = make_engine(path, block_size=8, compile=False, max_total_tokens=96,
                        max_batch_total_tokens=112)
    seqs = tight.generate(distinct, GREEDY)
    assert tight.scheduler.num_preemptions > 0
    assert [s.cached_tokens for s in seqs] == [0] * 6
    _all_free_or_evictable(tight)


def test_hits_within_one_step_and_whole_prompt_repeat(tiny_model: Callable[[str], Path]) -> None:
    """Requests arriving together share blocks keyed in the same step; an identical
    prompt reuses everything but its last token."""
    path = tiny_model("qwen2_bias_tied")
    prompts = _shared_prefix_prompts(3)
    prompts.append(list(prompts[0]))
    expected = reference_greedy(path, prompts, 32)
    engine = make_engine(path, block_size=8)
    assert [s.output_token_ids for s in engine.generate(prompts, GREEDY)] == expected
    assert engine.block_manager.hits >= 3 * (45 // 8)
    _all_free_or_evictable(engine)


def test_eviction_under_pressure_keeps_outputs(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama_gqa")
    prompts = _shared_prefix_prompts(8, prefix_len=30)
    expected = reference_greedy(path, prompts, 32)
    engine = make_engine(path, block_size=8, max_total_tokens=96, max_batch_total_tokens=128)
    seqs = engine.generate(prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == expected
    _all_free_or_evictable(engine)


def test_unchunked_prefill_with_tgi_join_rules(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama_gqa")
    prompts = _shared_prefix_prompts(6)
    expected = reference_greedy(path, prompts, 32)
    engine = make_engine(
        path, chunked_prefill=False, max_batch_prefill_tokens=255, waiting_served_ratio=2.0,
        max_waiting_tokens=3, prefix_caching=False,
    )
    seqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts[:2])]
    engine.step()  # both prompts whole, in one step
    assert all(s.num_computed_tokens == s.num_prompt_tokens for s in seqs)
    seqs += [engine.add_request(f"r{i + 2}", p, GREEDY) for i, p in enumerate(prompts[2:5])]
    engine.step()  # 3 waiting < 2.0 x 2 running: they wait
    assert len(engine.scheduler.running) == 2
    engine.step()
    engine.step()  # max_waiting_tokens=3 decode steps passed: they join
    assert len(engine.scheduler.running) == 2
    engine.step()
    assert len(engine.scheduler.running) == 5
    seqs.append(engine.add_request("r5", prompts[5], GREEDY))
    while engine.has_work():
        engine.step()
    assert [s.output_token_ids for s in seqs] == expected
    assert_all_blocks_free(engine)


def test_sampled_requests_report_their_seed(tiny_model: Callable[[str], Path]) -> None:
    engine = make_engine(tiny_model("llama_gqa"))
    params = SamplingParams(max_tokens=8, temperature=0.9, ignore_eos=True)
    a, b = engine.generate([[5, 6, 7], [5, 6, 7]], params)
    seed = a.seed
    again = engine.generate([[5, 6, 7]], SamplingParams(
        max_tokens=8, temperature=0.9, ignore_eos=True, seed=seed))[0]
    assert again.output_token_ids == a.output_token_ids
    assert a.seed != b.seed
