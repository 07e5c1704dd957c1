"""`n` choices: forked sequences share the prompt's KV blocks, copy on write keeps them apart."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from backends.base import SamplingParams
from backends.native.layers.attention import KVCache
from backends.native.llm_engine import LLMEngine
from backends.native.scheduling.block_manager import BlockManager
from backends.native.scheduling.scheduler import Scheduler, SchedulerConfig
from backends.native.scheduling.sequence import Sequence, SequenceStatus
from tests.native.test_parity import assert_all_blocks_free, make_engine, reference_greedy

PROMPT_LEN = 13  # not a multiple of the block size: the last prompt block is shared and written


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(n)), SamplingParams(), max_tokens=8)


def _computed(blocks: BlockManager, rid: str, n: int) -> Sequence:
    seq = _seq(rid, n)
    blocks.allocate(seq, n)
    seq.num_computed_tokens = n
    return seq


def _fork(blocks: BlockManager, parent: Sequence, rid: str) -> Sequence:
    child = _seq(rid, parent.num_prompt_tokens)
    blocks.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    return child


def test_fork_shares_blocks_and_copies_the_partial_block_on_write() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    parent = _computed(blocks, "p", 6)  # blocks: [full, half-filled]
    child = _fork(blocks, parent, "c")
    assert child.block_table == parent.block_table
    assert blocks.num_used_blocks == 2
    blocks.check_integrity()

    assert blocks.blocks_needed(child, 7) == 1  # the copy of the shared half-filled block
    blocks.allocate(child, 7)
    full, shared = parent.block_table
    assert child.block_table[0] == full and child.block_table[1] != shared
    assert blocks.take_copies() == [(shared, child.block_table[1])]
    assert blocks.take_copies() == []
    blocks.check_integrity()

    blocks.allocate(parent, 7)  # now the only holder: writes in place
    assert parent.block_table == [full, shared] and blocks.take_copies() == []
    blocks.free(parent)
    blocks.free(child)
    blocks.check_integrity()
    assert blocks.num_free_blocks == 8


def test_only_writers_of_shared_blocks_copy() -> None:
    """Three holders: the first two writers copy, the last writes the original."""
    blocks = BlockManager(num_blocks=8, block_size=4)
    a = _computed(blocks, "a", 5)
    b, c = _fork(blocks, a, "b"), _fork(blocks, a, "c")
    original = a.block_table[1]
    for seq in (a, b, c):
        blocks.allocate(seq, 6)
        blocks.check_integrity()
    copies = blocks.take_copies()
    assert [src for src, _ in copies] == [original, original]
    assert c.block_table[1] == original
    assert len({a.block_table[1], b.block_table[1], c.block_table[1]}) == 3
    assert len({a.block_table[0], b.block_table[0], c.block_table[0]}) == 1


def test_a_full_last_block_is_never_copied() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    parent = _computed(blocks, "p", 8)
    child = _fork(blocks, parent, "c")
    blocks.allocate(child, 9)
    blocks.allocate(parent, 9)
    assert blocks.take_copies() == []
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]
    blocks.check_integrity()


def test_copy_on_write_without_a_free_block_raises_and_changes_nothing() -> None:
    blocks = BlockManager(num_blocks=2, block_size=4)
    parent = _computed(blocks, "p", 6)
    child = _fork(blocks, parent, "c")
    table = list(child.block_table)
    assert not blocks.can_allocate(blocks.blocks_needed(child, 7))
    with pytest.raises(MemoryError):
        blocks.allocate(child, 7)
    assert child.block_table == table and blocks.take_copies() == []
    blocks.check_integrity()


def test_freeing_a_fork_keeps_the_parent_blocks() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4, prefix_caching=True)
    parent = _computed(blocks, "p", 10)
    child = _fork(blocks, parent, "c")
    blocks.free(child)
    blocks.check_integrity()
    assert blocks.num_used_blocks == 3
    blocks.free(parent)
    blocks.check_integrity()
    assert blocks.num_evictable_blocks == 2  # the two full prompt blocks stay cached


def test_kv_cache_copy_blocks_copies_every_layer() -> None:
    cache = KVCache(3, num_blocks=4, block_size=2, kv_heads=1, head_dim=2,
                    dtype=torch.float32, device=torch.device("cpu"))
    for layer in (*cache.k, *cache.v):
        layer.copy_(torch.randn(layer.shape))
    before = [t.clone() for t in (*cache.k, *cache.v)]
    cache.copy_blocks([(1, 3), (0, 2)])
    for old, new in zip(before, (*cache.k, *cache.v), strict=True):
        assert torch.equal(new[3], old[1]) and torch.equal(new[2], old[0])
        assert torch.equal(new[:2], old[:2])


# -- the engine ------------------------------------------------------------------------------

def _prompt(length: int = PROMPT_LEN, seed: int = 7) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (length,), generator=gen).tolist()


def _choices(seq: Sequence) -> list[Sequence]:
    return seq.choices


def _run_checked(engine: LLMEngine) -> None:
    while engine.has_work():
        engine.step()
        engine.block_manager.check_integrity()


def _generate(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    seqs = [engine.add_request(f"r{i}", p, s)
            for i, (p, s) in enumerate(zip(prompts, params, strict=True))]
    _run_checked(engine)
    return [[c.output_token_ids for c in _choices(s)] for s in seqs]


@pytest.fixture(scope="module")
def path(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama_gqa")


def test_greedy_choices_are_identical_to_a_single_greedy_run(path: Path) -> None:
    prompt = _prompt()
    (expected,) = reference_greedy(path, [prompt], 16)
    engine = make_engine(path, block_size=8)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, n=3)
    (outputs,) = _generate(engine, [prompt], [greedy])
    assert outputs == [expected] * 3
    assert [c.index for c in engine.generate([prompt], greedy)[0].choices] == [0, 1, 2]
    assert_all_blocks_free(engine)


def _sampled(n: int, seed: int | None = 5) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, n=n, seed=seed)


def test_seeded_choices_are_distinct_and_reproducible(path: Path) -> None:
    prompt = _prompt()
    first = _generate(make_engine(path, block_size=8), [prompt], [_sampled(3)])[0]
    again = _generate(make_engine(path, block_size=8), [prompt], [_sampled(3)])[0]
    assert first == again
    assert len({tuple(tokens) for tokens in first}) == 3
    seqs = make_engine(path, block_size=8).generate([prompt], _sampled(3))
    assert [c.seed for c in _choices(seqs[0])] == [5, 6, 7]
    unseeded = make_engine(path, block_size=8).generate([prompt], _sampled(2, seed=None))
    assert all(isinstance(c.seed, int) for c in _choices(unseeded[0]))


def test_choices_equal_independent_requests_with_their_seeds(path: Path) -> None:
    """The prompt's last block is shared and half full when the choices fork: each choice's
    writes land in its own copy, or the siblings' tokens would differ from solo runs."""
    prompt = _prompt()
    forked = _generate(make_engine(path, block_size=8), [prompt], [_sampled(4)])[0]
    solo = make_engine(path, block_size=8, prefix_caching=False)
    alone = [_generate(solo, [prompt], [_sampled(1, seed=5 + i)])[0][0] for i in range(4)]
    assert forked == alone


def test_preemption_keeps_the_choices_outputs(path: Path) -> None:
    prompts = [_prompt(13, seed=1), _prompt(21, seed=2), _prompt(6, seed=3)]
    params = [_sampled(3), _sampled(2, seed=9),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2)]
    roomy = _generate(make_engine(path, block_size=4), prompts, params)
    tight = make_engine(path, block_size=4, max_total_tokens=48, max_batch_total_tokens=48)
    assert _generate(tight, prompts, params) == roomy
    assert tight.scheduler.num_preemptions > 0
    assert_all_blocks_free(tight)


def test_abort_ends_every_choice_and_spares_other_requests(path: Path) -> None:
    prompt, other = _prompt(), _prompt(9, seed=4)
    engine = make_engine(path, block_size=8)
    (alone,) = _generate(make_engine(path, block_size=8), [other], [_sampled(1, seed=3)])
    victim = engine.add_request("victim", prompt, _sampled(3))
    survivor = engine.add_request("survivor", other, _sampled(1, seed=3))
    for _ in range(3):
        engine.step()
    assert all(c.block_table for c in _choices(victim))  # forked and running
    engine.abort("victim")
    assert all(c.finish_reason == "abort" for c in _choices(victim))
    engine.block_manager.check_integrity()
    _run_checked(engine)
    assert [survivor.output_token_ids] == alone
    assert_all_blocks_free(engine)


def test_each_choice_reports_its_own_usage_and_index(path: Path) -> None:
    engine = make_engine(path, block_size=8)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=3, ignore_eos=True,
                            stop_token_ids=(), stop=())
    engine.add_request("r", _prompt(), params)
    finals = []
    while engine.has_work():
        finals += [o for o in engine.step() if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert {(o.request_id, o.prompt_tokens, o.completion_tokens) for o in finals} == {
        ("r", PROMPT_LEN, 6)
    }


def test_preempting_a_sibling_can_spare_the_copy_on_write() -> None:
    """Parent and child share a half-full block and no block is free: the parent would need
    one for its copy, but once the child is preempted it holds the block alone and writes in
    place. Reserving with the stale count would preempt the parent as well."""
    blocks = BlockManager(num_blocks=2, block_size=4, prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_batch_size=8, max_batch_prefill_tokens=64), blocks)
    parent = _computed(blocks, "p", 6)
    child = _fork(blocks, parent, "c")
    for seq in (parent, child):
        seq.append_token(7, 0.0)  # one new token each to decode
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
    batch = scheduler.schedule()
    assert batch.seqs == [parent] and batch.num_tokens == [1]
    assert list(scheduler.waiting) == [child] and scheduler.num_preemptions == 1
    assert blocks.take_copies() == []
    blocks.check_integrity()


def test_choices_are_admitted_only_when_they_all_fit_the_batch(path: Path) -> None:
    """max_batch_size bounds the running sequences, forks included; a request with more
    choices than that still runs, alone."""
    engine = make_engine(path, block_size=8, max_batch_size=4)
    requests = [_sampled(3), _sampled(3, seed=8), _sampled(6, seed=20)]
    seqs = [engine.add_request(f"r{i}", _prompt(9, seed=i), p) for i, p in enumerate(requests)]
    widest = 0
    while engine.has_work():
        engine.step()
        running = engine.scheduler.running
        groups = {s.group_id for s in running}
        widest = max(widest, len(running))
        assert len(running) <= 4 or groups == {"r2"}
    assert widest == 6
    assert all(len(c.output_token_ids) == 12 for s in seqs for c in _choices(s))
    assert_all_blocks_free(engine)


def test_a_failed_step_drops_its_queued_block_copies(path: Path) -> None:
    """The copy-on-write copies of a step that fails must not run in a later step: their
    destination blocks were freed with the failed request and may belong to another."""
    engine = make_engine(path, block_size=8)
    engine.add_request("r", _prompt(), _sampled(2))
    engine.step()  # prompt computed, forked: both choices share the half-full last block

    def broken(seqs):
        raise RuntimeError("grammar worker died")

    engine.grammars.submit_masks = broken  # type: ignore[method-assign]
    outputs = engine.step()  # the choices' writes queued a copy, then the step failed
    assert outputs == [] and engine.block_manager.take_copies() == []
    while engine.has_work():  # each choice retried alone: the first fails the request
        outputs += engine.step()
    assert sorted((o.index, o.finish_reason) for o in outputs) == [(0, "error"), (1, "error")]
    assert_all_blocks_free(engine)


def test_a_failure_while_appending_tokens_fails_the_requests_and_keeps_finished_outputs(
    path: Path,
) -> None:
    """The step is retried without the finished choice, each request alone: "bad" fails
    again and fails; a choice that already finished in that step still reports it, or its
    stream would wait forever."""
    engine = make_engine(path, block_size=8)
    done = engine.add_request("done", _prompt(5, seed=3), SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True))
    bad = engine.add_request("bad", _prompt(), _sampled(2))
    engine.step()  # both prompts computed, "bad" forked
    output = _choices(bad)[1].output
    assert output is not None
    output.detokenizer.add = None  # calling it raises TypeError
    outputs = engine.step()  # "done" appends (and finishes) first, then "bad#1" raises
    assert done.is_finished and done.finish_reason == "length"
    while engine.has_work():
        outputs += engine.step()
    finals = {(o.request_id, o.index): o.finish_reason for o in outputs if o.finished}
    assert finals == {("done", 0): "length", ("bad", 0): "error", ("bad", 1): "error"}
    assert not engine.has_work()
    assert_all_blocks_free(engine)


def test_fail_all_finishes_every_choice_in_flight(path: Path) -> None:
    engine = make_engine(path, block_size=8)
    engine.add_request("a", _prompt(), _sampled(3))
    engine.add_request("b", _prompt(9, seed=4), _sampled(1))
    engine.step()
    outputs = engine.fail_all()
    assert sorted((o.request_id, o.index, o.finish_reason) for o in outputs) == [
        ("a", 0, "error"), ("a", 1, "error"), ("a", 2, "error"), ("b", 0, "error")]
    assert not engine.has_work() and engine.fail_all() == []
    assert_all_blocks_free(engine)
