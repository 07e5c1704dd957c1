"""The native engine's embeddings: prompts pooled into vectors instead of sampled.

An embedding request is one group of sequences, one per input, each a prompt with no tokens
to generate. They go through the same scheduler, paged KV cache and batching as generation
(chunked prefill, preemption, the prefix cache for last-token pooling); each step the runner
returns the final hidden states (after the final norm) of the rows the pooling needs
(runner/pooled_rows.py), which are folded into the sequence's `PoolState`. In the step that
completes its prompt a sequence is finished: its blocks go back at once and its vector, the
pooled state (normalised when the model's config says so), is its one output.
"""

from __future__ import annotations

import numpy as np
import torch

from backends.base import SamplingParams
from backends.native.runner.pooled_rows import PooledRows
from backends.native.scheduling.sequence import PoolState, Sequence
from backends.pooling import Pooling

# Nothing is sampled; a request's outputs end with its vectors.
_NO_SAMPLING = SamplingParams(max_tokens=0, temperature=0.0)


class Pooler:
    def __init__(self, pooling: Pooling) -> None:
        self.pooling = pooling

    @property
    def mode(self) -> str:
        return self.pooling.mode

    def sequence(self, request_id: str, index: int, prompt: list[int], now: float) -> Sequence:
        """Input `index` of embedding request `request_id`."""
        return Sequence(f"{request_id}#{index}", list(prompt), _NO_SAMPLING, 0,
                        arrival_time=now, group_id=request_id, index=index,
                        pool=PoolState(self.pooling.mode))

    def add(self, pooled: PooledRows) -> None:
        """Fold a step's pooled rows into their sequences' states."""
        for span in pooled.spans:
            state = span.seq.pool
            assert state is not None, "only embedding sequences are pooled"
            rows = pooled.hidden[span.first : span.first + span.count]
            if span.restart or state.total is None or state.mode != "mean":
                state.total, state.rows = rows.sum(0), span.count
            else:
                state.total, state.rows = state.total + rows.sum(0), state.rows + span.count

    def vector(self, seq: Sequence) -> np.ndarray:
        """The float32 vector of a sequence whose prompt is complete."""
        state = seq.pool
        assert state is not None and state.total is not None and state.rows
        vector = state.total / state.rows if state.mode == "mean" else state.total
        if self.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.cpu().numpy().astype(np.float32)
