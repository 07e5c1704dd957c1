"""Failure isolation inside the engine: a step that raises is undone and its requests are
retried one at a time, so only the request that still fails alone fails, and the others'
greedy tokens are those of a run without the fault. Deadlines (--queue-timeout,
--request-timeout) end requests with "abort" and their reason."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from backends.base import SamplingParams
from backends.native.llm_engine import LLMEngine, RequestOutput
from backends.native.scheduling.sequence import Sequence
from backends.native.scheduling.step_faults import InjectedFault
from tests.native.test_parity import assert_all_blocks_free, make_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts(count: int = 8) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 17, 40, 9, 25, 61, 5, 33]
    return [torch.randint(3, 49152, (lengths[i % 8],), generator=gen).tolist()
            for i in range(count)]


@pytest.fixture(scope="module")
def path(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama_gqa")


@pytest.fixture(scope="module")
def baseline(path: Path) -> list[list[int]]:
    engine = make_engine(path, block_size=8)
    return [seq.output_token_ids for seq in engine.generate(_prompts(), GREEDY)]


def _run(engine: LLMEngine, steps_before_fault: int, fault: str,
         ) -> tuple[list[Sequence], dict[str, RequestOutput]]:
    """Add r0..r7, step, then inject the fault; the sequences and each request's last output."""
    seqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(_prompts())]
    finals: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_work():
        if steps == steps_before_fault:
            engine.faults.add(fault)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
    return seqs, finals


@pytest.mark.parametrize("steps_before_fault", [0, 6], ids=["prefill", "decode"])
def test_a_fault_for_one_request_fails_it_alone(
    path: Path, baseline: list[list[int]], steps_before_fault: int,
) -> None:
    engine = make_engine(path, block_size=8)
    seqs, finals = _run(engine, steps_before_fault, fault="r3")
    assert finals["r3"].finish_reason == "error"
    for i, (seq, want) in enumerate(zip(seqs, baseline, strict=True)):
        if i != 3:
            assert finals[seq.request_id].finish_reason == "length"
            assert seq.output_token_ids == want, seq.request_id
    assert engine.num_step_failures >= 2  # the batch, then r3 alone
    assert engine.num_failed_requests == 1
    assert not engine.scheduler.solo
    assert_all_blocks_free(engine)


def test_a_transient_fault_fails_nobody(path: Path, baseline: list[list[int]]) -> None:
    """A step that fails once (no request to blame) is retried: everyone completes."""
    engine = make_engine(path, block_size=8)
    run, calls = engine.runner.run, {"n": 0}

    def flaky(batch, greedy=False):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("CUDA error: an illegal memory access (simulated)")
        return run(batch, greedy)

    engine.runner.run = flaky  # type: ignore[method-assign]
    seqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(_prompts())]
    while engine.has_work():
        engine.step()
    assert [s.output_token_ids for s in seqs] == baseline
    assert all(s.finish_reason == "length" for s in seqs)
    assert engine.num_step_failures == 1 and engine.num_failed_requests == 0
    assert_all_blocks_free(engine)


def test_a_fault_in_a_request_with_choices_fails_all_its_choices(path: Path) -> None:
    engine = make_engine(path, block_size=8)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3, ignore_eos=True)
    engine.add_request("multi", _prompts()[1], sampled)
    other = engine.add_request("other", _prompts()[2], GREEDY)
    engine.step()
    engine.step()  # forked, decoding
    engine.faults.add("multi")
    finals = []
    while engine.has_work():
        finals += [o for o in engine.step() if o.finished]
    reasons = sorted((o.request_id, o.index, o.finish_reason) for o in finals)
    assert reasons == [("multi", 0, "error"), ("multi", 1, "error"), ("multi", 2, "error"),
                       ("other", 0, "length")]
    alone = make_engine(path, block_size=8).generate([_prompts()[2]], GREEDY)[0]
    assert other.output_token_ids == alone.output_token_ids
    assert_all_blocks_free(engine)


def test_the_fault_hook_raises_only_for_its_ids(path: Path) -> None:
    engine = make_engine(path, block_size=8, fault_request_ids=frozenset({"bad"}))
    engine.add_request("good", _prompts()[0], GREEDY)
    assert engine.faults == {"bad"}
    outputs = engine.step()
    assert outputs and not any(o.finish_reason == "error" for o in outputs)
    engine.add_request("bad", _prompts()[3], GREEDY)
    with pytest.raises(InjectedFault, match="bad"):
        from backends.native.scheduling.step_faults import raise_injected_fault

        raise_injected_fault(engine.faults, engine.scheduler.schedule())


def test_queue_timeout_ends_a_request_that_never_started(path: Path) -> None:
    engine = make_engine(path, block_size=8, max_batch_size=1, queue_timeout=0.05)
    running = engine.add_request("running", _prompts()[0], GREEDY)
    engine.add_request("waiting", _prompts()[1], GREEDY)
    engine.step()
    time.sleep(0.1)
    outputs = engine.step()
    ended = [o for o in outputs if o.request_id == "waiting"]
    assert [(o.finish_reason, o.stop_reason, o.completion_tokens) for o in ended] == [
        ("abort", "queue_timeout", 0)]
    assert engine.num_queue_timeouts == 1
    while engine.has_work():  # the running request is past the queue: not timed out
        engine.step()
    assert running.finish_reason == "length"
    assert engine.take_started() == ["running"]
    assert_all_blocks_free(engine)


def test_request_timeout_ends_a_running_request(path: Path) -> None:
    engine = make_engine(path, block_size=8, request_timeout=0.2)
    engine.add_request("slow", _prompts()[0], SamplingParams(max_tokens=200, temperature=0.0,
                                                             ignore_eos=True))
    finals: list[RequestOutput] = []
    tokens = 0
    deadline = time.monotonic() + 30
    while engine.has_work() and time.monotonic() < deadline:
        for out in engine.step():
            tokens += len(out.tokens)
            if out.finished:
                finals.append(out)
        time.sleep(0.01)
    assert [(o.finish_reason, o.stop_reason) for o in finals] == [("abort", "request_timeout")]
    assert 0 < tokens < 200 and engine.num_request_timeouts == 1
    assert_all_blocks_free(engine)


def test_a_fault_while_sharing_fresh_prefix_blocks_leaves_the_sharer_exact(path: Path) -> None:
    """Two prompts with a common 24-token prefix join in one step: the second reuses blocks
    the first keys (and writes) in that very step. The first faults: the step is undone, the
    blocks uncached, and the second's tokens are still those of a run alone."""
    prefix = _prompts()[5][:24]
    first, second = prefix + [11, 12, 13], prefix + [21, 22]
    alone = make_engine(path, block_size=8).generate([second], GREEDY)[0].output_token_ids
    engine = make_engine(path, block_size=8, fault_request_ids=frozenset({"first"}))
    engine.add_request("first", first, GREEDY)
    shared = engine.add_request("second", second, GREEDY)
    outputs = []
    while engine.has_work():
        outputs += [o for o in engine.step() if o.finished]
    assert {(o.request_id, o.finish_reason) for o in outputs} == {
        ("first", "error"), ("second", "length")}
    assert shared.output_token_ids == alone
    assert engine.block_manager.hits >= 3  # the prefix was shared before the fault
    assert_all_blocks_free(engine)
