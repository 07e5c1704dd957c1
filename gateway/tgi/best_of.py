"""TGI's `best_of`: of the sampled choices, the one with the highest sum of token logprobs
answers; the others are listed in `details.best_of_sequences`."""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.generation import Collected


def logprob_sum(got: Collected) -> float:
    """A choice's total logprob (-inf when a token has none: it cannot be ranked)."""
    total = 0.0
    for token in got.tokens:
        if token.logprob is None or math.isnan(token.logprob):
            return -math.inf
        total += token.logprob
    return total


def best_choice(choices: Sequence[Collected]) -> int:
    """The index of the most likely choice (the first one on a tie)."""
    sums = [logprob_sum(got) for got in choices]
    return max(range(len(sums)), key=lambda i: (sums[i], -i))
