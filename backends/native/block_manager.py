"""KV blocks: a free list, reference counts and per-sequence block tables. Pure Python."""

from __future__ import annotations

from collections import deque

from backends.native.sequence import Sequence


class BlockIntegrityError(AssertionError):
    pass


class BlockManager:
    """Hands out fixed-size KV blocks. Slot of token i of a sequence:
    `block_table[i // block_size] * block_size + i % block_size`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._owners: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        return max(0, self.blocks_for_tokens(num_tokens) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_tokens` tokens."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            raise MemoryError(f"need {needed} KV blocks, {len(self._free)} free")
        for _ in range(needed):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            seq.block_table.append(block)
        self._owners[seq.request_id] = seq.block_table

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
        seq.block_table = []
        self._owners.pop(seq.request_id, None)

    def check_integrity(self) -> None:
        """free + used == total; every used block's ref count equals its owners."""
        counted = [0] * self.num_blocks
        for table in self._owners.values():
            for block in table:
                counted[block] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockIntegrityError("a block is on the free list twice")
        for block in range(self.num_blocks):
            if counted[block] != self._ref_counts[block]:
                raise BlockIntegrityError(
                    f"block {block}: ref count {self._ref_counts[block]}, owners {counted[block]}"
                )
            if (block in free) == (counted[block] > 0):
                raise BlockIntegrityError(
                    f"block {block}: free={block in free}, owners={counted[block]}"
                )
