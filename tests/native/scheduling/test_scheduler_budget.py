"""The prefill budget with chunked prefill: decode rows count against it (TGI v3, vLLM), so a
step's rows stay within `max_batch_prefill_tokens`; prompts still advance beside any number
of decode rows. No model: steps are simulated."""

from __future__ import annotations

from backends.base import SamplingParams
from backends.native.scheduling.block_manager import BlockManager
from backends.native.scheduling.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from backends.native.scheduling.sequence import Sequence


def _scheduler(budget: int, chunked: bool = True) -> Scheduler:
    blocks = BlockManager(num_blocks=64, block_size=4, prefix_caching=False)
    # waiting_served_ratio 0: unchunked, a waiting request joins a running batch at once
    config = SchedulerConfig(8, budget, chunked_prefill=chunked, waiting_served_ratio=0.0)
    return Scheduler(config, blocks)


def _add(scheduler: Scheduler, name: str, prompt_len: int) -> Sequence:
    seq = Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(), max_tokens=50)
    scheduler.add(seq)
    return seq


def _step(scheduler: Scheduler) -> ScheduledBatch:
    batch = scheduler.schedule()
    samplers = batch.sampling_seqs()
    scheduler.postprocess(batch)
    for seq in samplers:
        seq.append_token(7, None)
    return batch


def _decoding(scheduler: Scheduler, count: int) -> None:
    for i in range(count):
        _add(scheduler, f"d{i}", 2)
    _step(scheduler)  # their prompts: every one decodes from here on


def test_decode_rows_count_against_the_chunked_budget() -> None:
    scheduler = _scheduler(budget=8)
    _decoding(scheduler, 3)
    late = _add(scheduler, "late", 20)
    batch = _step(scheduler)
    assert sum(batch.num_tokens) == 8
    assert batch.num_tokens[batch.seqs.index(late)] == 5


def test_prompts_advance_beside_more_decode_rows_than_the_budget() -> None:
    scheduler = _scheduler(budget=4)
    _decoding(scheduler, 2)
    late = _add(scheduler, "late", 6)
    _step(scheduler)  # 2 decode rows, 2 of late's tokens
    _add(scheduler, "more", 2)
    _step(scheduler)  # 2 decode rows, 2 more of late's: "more" waits for the budget
    assert late.num_computed_tokens == 4
    _step(scheduler)  # late's last 2: it decodes from here on, "more" joins for 1
    batch = _step(scheduler)  # 3 decode rows and a budget of 4: "more" gets 1 a step
    assert batch.num_tokens == [1, 1, 1, 1]
    assert late.num_output_tokens == 2


def test_unchunked_budget_ignores_decode_rows() -> None:
    scheduler = _scheduler(budget=24, chunked=False)
    _decoding(scheduler, 3)
    late = _add(scheduler, "late", 20)
    batch = _step(scheduler)
    assert batch.num_tokens[batch.seqs.index(late)] == 20
