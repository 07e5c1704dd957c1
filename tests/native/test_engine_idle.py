"""The engine keeps no request after it ends, however it ends: finished, aborted while a
failed step's suspects are retried alone, or failed itself."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from backends.base import SamplingParams
from backends.native.llm_engine import LLMEngine
from tests.native.test_parity import assert_all_blocks_free, make_engine


def _held(engine: LLMEngine) -> dict[str, int]:
    scheduler, blocks = engine.scheduler, engine.block_manager
    sizes = {"groups": len(engine._groups), "waiting": len(scheduler.waiting),
             "running": len(scheduler.running), "solo": len(scheduler.solo),
             "owners": len(blocks._owners), "copies": len(blocks._copies),
             "started": len(engine.started)}
    return {name: n for name, n in sizes.items() if n}


def test_an_abort_during_the_solo_retry_leaves_nothing(tiny_model: Callable[[str], Path]) -> None:
    engine = make_engine(tiny_model("llama_gqa"), compile=False, block_size=8)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("bad", [5, 6, 7, 8, 9], greedy)
    engine.add_request("good", [9, 8, 7, 6, 5, 4], greedy)
    engine.add_request("forked", [4, 4, 4], SamplingParams(max_tokens=20, n=2, seed=1))
    engine.faults.add("bad")
    engine.step()  # the batch fails: all three go back to the queue, to run alone
    assert len(engine.scheduler.solo) == 3
    engine.step()  # "bad" fails alone
    engine.abort("good")  # the client leaves while its request waits for its solo turn
    engine.abort("forked")
    engine.take_started()
    assert not engine.has_work()
    assert _held(engine) == {}
    assert_all_blocks_free(engine)
