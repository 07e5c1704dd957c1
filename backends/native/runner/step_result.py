"""What one model step computed for the sequences that sample: logits, or greedy tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepLogits:
    """Float32 logits [S + P, V]: row i < S samples for the i-th sampling sequence, the P rows
    after them are the batch's prompt-logprob positions (`ScheduledBatch.prompt_spans()`)."""

    logits: torch.Tensor


@dataclass(frozen=True)
class GreedyTokens:
    """Each sampling sequence's greedy token, chosen by the greedy head without the logits
    (greedy_head.py); only for steps whose every row is plain greedy, so no P rows."""

    token_ids: list[int]


StepResult = StepLogits | GreedyTokens
