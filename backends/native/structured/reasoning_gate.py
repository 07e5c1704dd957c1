"""A thinking model's structured output: the grammar constrains the answer, not the reasoning.

While the model reasons (between its think markers) sampling is free; the grammar starts with
the token after the end marker. A choice whose prompt did not open the reasoning is undecided
at its first token: the grammar's tokens or the start marker may come (a Qwen3-style model
opens its reasoning itself; one told not to think answers at once, under the grammar).
"""

from __future__ import annotations

from enum import Enum

from backends.native.structured.matcher import GrammarMatcher
from backends.text.reasoning import ReasoningMarkers


class _Stage(Enum):
    UNDECIDED = "undecided"  # first token: the start marker or the grammar's
    REASONING = "reasoning"  # free until the end marker
    ANSWER = "answer"  # the grammar rules


class AfterReasoning(GrammarMatcher):
    """A grammar matcher that waits for the reasoning to end."""

    def __init__(self, inner: GrammarMatcher, markers: ReasoningMarkers,
                 reasoning: bool) -> None:
        super().__init__(inner.engine_matcher, inner.engine_vocab)
        self._markers = markers
        self._stage = _Stage.REASONING if reasoning else _Stage.UNDECIDED

    def accept(self, token_id: int) -> bool:
        if self._stage is _Stage.REASONING:
            if token_id == self._markers.end_id:
                self._stage = _Stage.ANSWER
            return True
        if self._stage is _Stage.UNDECIDED:
            if token_id == self._markers.start_id:
                self._stage = _Stage.REASONING
                return True
            self._stage = _Stage.ANSWER
        return super().accept(token_id)

    @property
    def is_terminated(self) -> bool:
        return self._stage is _Stage.ANSWER and super().is_terminated

    @property
    def constrains(self) -> bool:
        return self._stage is not _Stage.REASONING

    @property
    def also_allowed(self) -> tuple[int, ...]:
        return (self._markers.start_id,) if self._stage is _Stage.UNDECIDED else ()
