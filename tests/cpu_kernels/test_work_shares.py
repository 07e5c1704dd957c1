"""How our kernels deal their items to threads (cpu_kernels/work_shares.h): each thread works
its own share and then takes items from the back of others'. Whichever thread runs an item,
and however the items end up split, every item must run exactly once: the result with 2 or
3 threads, with a busy thread beside them taking a core now and then (so that shares are
taken over mid-call), is bit for bit the same every time, and for a linear the result with
one thread (decode attention splits a lone sequence's blocks by the thread count, which
rounds differently)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from backends.cpu_kernels.build import active_variant
from backends.native.layers.attention import decode_mask
from backends.native.layers.cpu_linear import pack_for_f32_kernel

pytestmark = pytest.mark.skipif(active_variant() is None,
                                reason="our CPU kernels do not build here")


@contextmanager
def busy_neighbour() -> Iterator[None]:
    """A thread that keeps a core busy in bursts while the kernels run."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            until = time.perf_counter() + 0.002
            while time.perf_counter() < until:
                pass
            time.sleep(0.001)

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def with_threads(threads: int, call: Callable[[], torch.Tensor]) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return call()
    finally:
        torch.set_num_threads(before)


def assert_same_on_any_threads(call: Callable[[], torch.Tensor], as_one_thread: bool,
                               repeats: int = 20) -> None:
    alone = with_threads(1, call)
    expected = {threads: alone if as_one_thread else with_threads(threads, call)
                for threads in (2, 3)}
    with busy_neighbour():
        for threads, result in expected.items():
            for _ in range(repeats):
                assert torch.equal(with_threads(threads, call), result), f"{threads} threads"


# Items (16-column blocks x row chunks) from 1 to 144: fewer items than threads, a few each,
# many each.
@pytest.mark.parametrize(("rows", "n"), [(1, 16), (5, 48), (64, 256), (333, 2304)])
def test_a_linear_runs_each_item_once(rows: int, n: int) -> None:
    weight = torch.randn(n, 96)
    packed = pack_for_f32_kernel(weight)
    x = torch.randn(rows, 96)
    assert_same_on_any_threads(lambda: torch.ops.switchyard_cpu.f32_linear(x, packed, None),
                               as_one_thread=True)


@pytest.mark.parametrize("batch", [1, 3, 40])
def test_decode_attention_runs_each_item_once(batch: int) -> None:
    heads, kv_heads, head_dim, block_size, context = 4, 2, 64, 16, 70
    width = -(-context // block_size)
    blocks = batch * width + 1
    k_cache, v_cache = (torch.randn(blocks, kv_heads, block_size, head_dim) for _ in "kv")
    q = torch.randn(batch, heads, head_dim)
    tables = torch.randperm(blocks)[: batch * width].view(batch, width)
    mask = decode_mask(torch.zeros(batch, dtype=torch.long),
                       torch.randint(1, context + 1, (batch,)), width * block_size)
    assert_same_on_any_threads(lambda: torch.ops.switchyard_cpu.paged_decode_attention(
        q, k_cache, v_cache, tables, mask, head_dim**-0.5), as_one_thread=batch > 1)
