"""Which rows of a step an embedding model pools, and what the step returns for them.

An embedding sequence is a prompt and nothing else: it is prefilled (in chunks, like any
prompt) and never samples. Each step computes the final hidden states of the rows its pooling
needs: every row of the chunk (mean), the prompt's first row (cls), its last row (last token,
in the step that completes the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.native.scheduling.scheduler import ScheduledBatch
from backends.native.scheduling.sequence import Sequence


@dataclass(frozen=True)
class PooledSpan:
    """`count` rows of `seq`, from `first` in the step's pooled rows; `restart`: they begin
    the prompt (position 0), so what an earlier, undone computation pooled is void."""

    seq: Sequence
    first: int
    count: int
    restart: bool


@dataclass(frozen=True)
class PooledRows:
    hidden: torch.Tensor  # float32 [sum of counts, hidden size], spans in order
    spans: list[PooledSpan]


def pooled_spans(batch: ScheduledBatch, starts: list[int], mode: str) -> tuple[list[int],
                                                                                 list[PooledSpan]]:
    """The step rows to compute (`starts[i]`: the row of sequence i's first new token) and
    each sequence's span of them."""
    rows: list[int] = []
    spans: list[PooledSpan] = []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
        computed = seq.num_computed_tokens
        if mode == "mean":
            wanted = range(starts[i], starts[i] + n)
        elif mode == "cls":
            wanted = range(starts[i], starts[i] + 1) if computed == 0 else range(0)
        else:  # last token: in the step that completes the prompt
            done = computed + n == seq.num_tokens
            wanted = range(starts[i] + n - 1, starts[i] + n) if done else range(0)
        if wanted:
            spans.append(PooledSpan(seq, len(rows), len(wanted), computed == 0))
            rows.extend(wanted)
    return rows, spans
