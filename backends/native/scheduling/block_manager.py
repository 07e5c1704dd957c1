"""KV blocks: a free list, reference counts, block tables and a prefix cache. Pure Python.

Prefix cache (vLLM's hash chain): a block full of known tokens is keyed by the hash
of (parent block's key, its tokens). Blocks with a key stay findable after their
last owner leaves: they wait, least recently used first, on the evictable list
and are only reused for other tokens when the free list is empty. Every hit is
checked against the stored tokens, so a hash collision can never serve wrong K/V.

Forks (the `n` choices of one request) share their parent's blocks by reference. Only a
sequence's partially filled last block is ever written, so copy-on-write happens there:
before a step writes into a block that others still hold, the writer gets a fresh block and
a (source, destination) copy is queued for the model runner to apply to every layer first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from backends.native.scheduling.sequence import Sequence


class BlockIntegrityError(AssertionError):
    pass


@dataclass(frozen=True)
class BlockKey:
    digest: int
    parent: int | None
    tokens: tuple[int, ...]


class BlockManager:
    """Slot of token i of a sequence:
    `block_table[i // block_size] * block_size + i % block_size`."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, keyed, LRU first
        self._ref_counts = [0] * num_blocks
        self._keys: dict[int, BlockKey] = {}  # block -> its key
        self._cached: dict[int, int] = {}  # digest -> block
        self._owners: dict[str, list[int]] = {}
        self._copies: list[tuple[int, int]] = []  # (src, dst) K/V copies for the next step
        self.queries = 0
        self.hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have slots (one
        more when the block the next token goes to is shared: copy on write)."""
        grow = max(0, self.blocks_for_tokens(num_tokens) - len(seq.block_table))
        return grow + (self._shared_write_block(seq, num_tokens) is not None)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def match_prefix(self, seq: Sequence) -> None:
        """Give a sequence with no blocks yet the cached blocks of its longest known prefix.

        The last token is always left to compute: its logits are needed.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.prefix_caching:
            return
        parent: int | None = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            self.queries += 1
            block = self._lookup(parent, tokens)
            if block is None:
                break
            self.hits += 1
            self._take(block)
            seq.block_table.append(block)
            parent = self._keys[block].digest
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.keyed_blocks, seq.last_key = len(seq.block_table), parent
        self._owners[seq.request_id] = seq.block_table

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_tokens` tokens and key the blocks that
        those tokens fill (their K/V is written by the step being scheduled)."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            raise MemoryError(f"need {needed} KV blocks, {self.num_free_blocks} free")
        shared = self._shared_write_block(seq, num_tokens)
        if shared is not None:
            self._copy_on_write(seq, shared)
        for _ in range(needed - (shared is not None)):
            block = self._pop_free()
            self._ref_counts[block] = 1
            seq.block_table.append(block)
        self._owners[seq.request_id] = seq.block_table
        if self.prefix_caching:
            self._key_full_blocks(seq, num_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's blocks (shared by reference) and keying progress."""
        assert not child.block_table
        for block in parent.block_table:
            self._ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        child.keyed_blocks, child.last_key = parent.keyed_blocks, parent.last_key
        child.keying_stopped = parent.keying_stopped
        self._owners[child.request_id] = child.block_table

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies queued since the last call; apply before writing."""
        copies, self._copies = self._copies, []
        return copies

    def _shared_write_block(self, seq: Sequence, num_tokens: int) -> int | None:
        """Index in seq's table of the block its next token goes to, if others hold it too."""
        if num_tokens <= seq.num_computed_tokens:
            return None
        i = seq.num_computed_tokens // self.block_size
        if i < len(seq.block_table) and self._ref_counts[seq.block_table[i]] > 1:
            return i
        return None

    def _copy_on_write(self, seq: Sequence, i: int) -> None:
        src, dst = seq.block_table[i], self._pop_free()
        self._ref_counts[src] -= 1  # still > 0: the other holders keep it
        self._ref_counts[dst] = 1
        seq.block_table[i] = dst
        self._copies.append((src, dst))

    def free(self, seq: Sequence, *, forget: bool = False) -> None:
        """Drop seq's references. `forget`: its blocks' contents are not to be trusted
        (a failed step), so they leave the prefix cache too."""
        for block in seq.block_table:
            if forget:
                self._unkey(block)
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if block in self._keys:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.keyed_blocks, seq.last_key, seq.keying_stopped = 0, None, False
        self._owners.pop(seq.request_id, None)

    def _lookup(self, parent: int | None, tokens: tuple[int, ...]) -> int | None:
        block = self._cached.get(hash((parent, tokens)))
        if block is None:
            return None
        key = self._keys[block]
        return block if key.parent == parent and key.tokens == tokens else None

    def _take(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._evictable[block]
        self._ref_counts[block] += 1

    def _pop_free(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        self._unkey(block)
        return block

    def _key_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        bs = self.block_size
        while not seq.keying_stopped and seq.keyed_blocks < num_tokens // bs:
            i = seq.keyed_blocks
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            key = BlockKey(hash((seq.last_key, tokens)), seq.last_key, tokens)
            if key.digest in self._cached:
                seq.keying_stopped = True  # content cached in another block: leave it plain
                return
            self._keys[seq.block_table[i]] = key
            self._cached[key.digest] = seq.block_table[i]
            seq.keyed_blocks, seq.last_key = i + 1, key.digest

    def _unkey(self, block: int) -> None:
        key = self._keys.pop(block, None)
        if key is not None and self._cached.get(key.digest) == block:
            del self._cached[key.digest]
        if block in self._evictable:
            del self._evictable[block]
            self._free.append(block)

    def check_integrity(self) -> None:
        """free + evictable + used == total; ref counts equal owners; keys consistent."""
        counted = [0] * self.num_blocks
        for table in self._owners.values():
            for block in table:
                counted[block] += 1
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free) or free & evictable:
            raise BlockIntegrityError("a block is on the free/evictable lists twice")
        for block in range(self.num_blocks):
            self._check_block(block, counted[block], block in free, block in evictable)
        for digest, block in self._cached.items():
            if self._keys.get(block) is None or self._keys[block].digest != digest:
                raise BlockIntegrityError(f"cache entry {digest} -> block {block} has no key")

    def _check_block(self, block: int, owners: int, is_free: bool, is_evictable: bool) -> None:
        if owners != self._ref_counts[block]:
            raise BlockIntegrityError(
                f"block {block}: ref count {self._ref_counts[block]}, owners {owners}"
            )
        if (is_free or is_evictable) == (owners > 0):
            raise BlockIntegrityError(
                f"block {block}: free={is_free} evictable={is_evictable}, owners={owners}"
            )
        if is_free and block in self._keys:
            raise BlockIntegrityError(f"block {block} is free but still keyed")
        if is_evictable and block not in self._keys:
            raise BlockIntegrityError(f"block {block} is evictable but has no key")
