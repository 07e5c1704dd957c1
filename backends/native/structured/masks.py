"""Per-step token masks: a packed int32 bitmask per row, and applying it to the logits."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch

from backends.native.structured.matcher import GrammarMatcher


def _words(tokens: int) -> int:
    return (tokens + 31) // 32


class TokenMasks:
    """One per engine: fills a reused [rows, ceil(V/32)] int32 buffer (bit j of word w is
    token 32w+j) for a whole batch in one call into llguidance, which releases the GIL and
    spreads the rows over its own threads."""

    def __init__(self, vocab_size: int, threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor(num_threads=threads)
        self._buffer = torch.full((0, 0), -1, dtype=torch.int32)

    def fill(self, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor | None:
        """Masks for `matchers` (rows without one are all ones); None when no row has one.

        The returned tensor is a view of the reused buffer: valid until the next call. A matcher
        may appear once per call, and must not `accept` while the fill runs."""
        active = [m if m is not None and m.constrains else None for m in matchers]
        rows = [(m.engine_matcher, i) for i, m in enumerate(active) if m is not None]
        if not rows:
            return None
        # The engine's width covers the whole tokenizer, which may be wider than the logits.
        width = max([_words(self.vocab_size)] + [m.mask_words for m in active if m is not None])
        buffer = self._reserve(len(matchers), width)
        for i, m in enumerate(active):
            if m is None:
                buffer[i].fill_(-1)
        if len(rows) == 1:
            row = buffer[rows[0][1]]
            rows[0][0].unsafe_compute_mask_ptr(row.data_ptr(), width * 4)
        else:
            self._executor.unsafe_compute_mask_ptr(rows, buffer.data_ptr(), width * 4,
                                                   len(matchers))
        for i, m in enumerate(active):
            for token in m.also_allowed if m is not None else ():
                _allow(buffer[i], token)
        return buffer[:, : _words(self.vocab_size)]

    def _reserve(self, count: int, width: int) -> torch.Tensor:
        if self._buffer.shape[0] < count or self._buffer.shape[1] != width:
            self._buffer = torch.full((max(count, 16), width), -1, dtype=torch.int32)
        return self._buffer[:count]


def _allow(row: torch.Tensor, token: int) -> None:
    """Set token's bit in a packed int32 row (bit 31 is the word's sign bit)."""
    bit = token % 32
    row[token // 32] |= (1 << bit) if bit < 31 else -(1 << 31)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[S, V] = -inf where the bit is 0; tokens past 32 * W are -inf too."""
    rows, vocab = logits.shape
    words = bitmask.shape[1]
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(rows, words * 32)[:, :vocab]
    if vocab > words * 32:
        logits[:, words * 32 :] = float("-inf")
        logits = logits[:, : words * 32]
    logits.masked_fill_(allowed == 0, float("-inf"))
