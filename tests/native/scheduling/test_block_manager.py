"""Block manager: allocation, freeing, integrity."""

from __future__ import annotations

import pytest

from backends.base import SamplingParams
from backends.native.scheduling.block_manager import BlockIntegrityError, BlockManager
from backends.native.scheduling.sequence import Sequence


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(n)), SamplingParams(), max_tokens=4)


def test_allocate_grows_by_whole_blocks_and_free_returns_them() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    a, b = _seq("a", 5), _seq("b", 4)
    blocks.allocate(a, 5)
    blocks.allocate(b, 4)
    assert len(a.block_table) == 2 and len(b.block_table) == 1
    assert blocks.num_free_blocks == 5
    blocks.allocate(a, 8)  # still fits in its two blocks
    assert len(a.block_table) == 2
    blocks.allocate(a, 9)
    assert len(a.block_table) == 3
    assert not set(a.block_table) & set(b.block_table)
    blocks.check_integrity()
    blocks.free(a)
    blocks.free(b)
    blocks.check_integrity()
    assert blocks.num_free_blocks == 8


def test_running_out_raises_and_changes_nothing() -> None:
    blocks = BlockManager(num_blocks=2, block_size=4)
    seq = _seq("a", 12)
    with pytest.raises(MemoryError):
        blocks.allocate(seq, 12)
    assert blocks.num_free_blocks == 2 and seq.block_table == []
    blocks.check_integrity()


def test_integrity_check_catches_a_leak() -> None:
    blocks = BlockManager(num_blocks=4, block_size=4)
    seq = _seq("a", 4)
    blocks.allocate(seq, 4)
    seq.block_table.append(3)  # a block the manager never handed out
    with pytest.raises(BlockIntegrityError):
        blocks.check_integrity()
