"""Randomised: any sequence of add / step / abort / finish keeps the block manager
whole and ends with every block free or evictable. No model: steps are simulated."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from backends.base import SamplingParams
from backends.native.scheduling.block_manager import BlockManager
from backends.native.scheduling.scheduler import Scheduler, SchedulerConfig
from backends.native.scheduling.sequence import Sequence

VOCAB = 4
BASES = [[i % VOCAB] * 3 + list(range(VOCAB)) * 8 for i in range(3)]  # shared prefixes

prompt = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail,
    st.integers(0, 2), st.integers(0, 30), st.lists(st.integers(0, VOCAB - 1), max_size=6),
).filter(bool)
add = st.tuples(st.just("add"), prompt, st.integers(1, 12))
step = st.tuples(st.just("step"), st.integers(0, VOCAB - 1), st.just(0))
abort = st.tuples(st.just("abort"), st.integers(0, 50), st.just(0))
finish = st.tuples(st.just("finish"), st.integers(0, 50), st.just(0))
operations = st.lists(st.one_of(add, add, step, step, step, abort, finish), max_size=80)


class Simulation:
    def __init__(self, num_blocks: int, block_size: int, config: SchedulerConfig,
                 prefix_caching: bool) -> None:
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(config, self.blocks)
        self.live: list[Sequence] = []
        self.count = 0

    def add(self, prompt: list[int], max_tokens: int) -> None:
        capacity = self.blocks.num_blocks * self.blocks.block_size
        max_tokens = min(max_tokens, capacity - len(prompt))
        if max_tokens < 1:
            return  # the backend refuses such a request at admission
        seq = Sequence(f"r{self.count}", prompt, SamplingParams(), max_tokens)
        self.count += 1
        self.live.append(seq)
        self.scheduler.add(seq)

    def step(self, token: int) -> None:
        batch = self.scheduler.schedule()
        if self.scheduler.has_work():
            assert batch.seqs, "work is waiting but nothing was scheduled: a stall"
        samplers = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            assert seq.num_computed_tokens + n <= len(seq.block_table) * self.blocks.block_size
        self.scheduler.postprocess(batch)
        for seq in samplers:
            seq.append_token(token, None)
            if seq.num_output_tokens >= seq.max_tokens:
                self._end(seq, "length")

    def end_at(self, index: int, reason: str) -> None:
        if self.live:
            self._end(self.live[index % len(self.live)], reason)

    def _end(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.live.remove(seq)


def _run(ops, num_blocks: int, block_size: int, config: SchedulerConfig, prefix: bool) -> None:
    sim = Simulation(num_blocks, block_size, config, prefix)
    for op, a, b in ops:
        if op == "add":
            sim.add(a, b)
        elif op == "step":
            sim.step(a)
        else:
            sim.end_at(a, "abort" if op == "abort" else "stop")
        sim.blocks.check_integrity()
    for _ in range(10_000):  # drain: everything admitted must finish
        if not sim.scheduler.has_work():
            break
        sim.step(0)
        sim.blocks.check_integrity()
    assert not sim.scheduler.has_work() and not sim.live
    assert sim.blocks.num_free_blocks == sim.blocks.num_blocks


@settings(max_examples=300, deadline=None)
@given(ops=operations, num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]),
       prefill_budget=st.integers(1, 64), batch_size=st.integers(1, 8), prefix=st.booleans())
def test_chunked_scheduling_keeps_blocks_whole(
    ops, num_blocks, block_size, prefill_budget, batch_size, prefix
) -> None:
    config = SchedulerConfig(batch_size, prefill_budget, chunked_prefill=True)
    _run(ops, num_blocks, block_size, config, prefix)


@settings(max_examples=100, deadline=None)
@given(ops=operations, num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]),
       batch_size=st.integers(1, 8), ratio=st.floats(0.0, 3.0), max_waiting=st.integers(0, 5),
       prefix=st.booleans())
def test_unchunked_scheduling_keeps_blocks_whole(
    ops, num_blocks, block_size, batch_size, ratio, max_waiting, prefix
) -> None:
    config = SchedulerConfig(batch_size, 40, chunked_prefill=False, waiting_served_ratio=ratio,
                             max_waiting_tokens=max_waiting)
    _run(ops, num_blocks, block_size, config, prefix)
