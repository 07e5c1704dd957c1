"""Thinking models' reasoning, told apart from the answer by the think marker tokens.

A thinking model (Qwen3, DeepSeek-R1 and its distills) writes its reasoning between a start
and an end marker (`<think>` / `</think>`), which its tokenizer has as added tokens. The split
is made on token ids, never on the text: a "<think>" the model spells out of ordinary tokens
is answer text. A template may open the reasoning in the prompt itself (DeepSeek-R1 ends its
generation prompt with `<think>\\n`): generation then starts inside the reasoning, which the
prompt's last marker token tells.

`ReasoningSplitter` follows one choice: it is told each generated token with the text piece it
decoded to, and then splits each released text delta (after stop strings, which may hold text
back or cut it) into its reasoning and content parts, the markers dropped. It counts reasoning
tokens as OpenAI and vLLM report them: every generated token from the start marker to the end
marker, both markers included.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from backends.base import ReasoningSplit

START_MARKER = "<think>"
END_MARKER = "</think>"


class _AddedToken(Protocol):
    content: str


@dataclass(frozen=True)
class ReasoningMarkers:
    """The ids (and decoded texts) of a tokenizer's think markers."""

    start_id: int
    end_id: int

    @classmethod
    def from_added_tokens(
        cls, added: Mapping[int, _AddedToken],
    ) -> ReasoningMarkers | None:
        """The markers among a tokenizer's added tokens (`added_tokens_decoder`); None when it
        lacks either: the model does not reason."""
        ids = {tok.content: token_id for token_id, tok in added.items()}
        if START_MARKER not in ids or END_MARKER not in ids:
            return None
        return cls(ids[START_MARKER], ids[END_MARKER])

    def opens_in(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt leaves the reasoning open: its last marker is a start marker."""
        for token in reversed(prompt_ids):
            if token == self.start_id:
                return True
            if token == self.end_id:
                return False
        return False


class Phase(Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    MARKER = "marker"  # the marker's own text (when it decodes to any): dropped


@dataclass
class _Span:
    """Characters [start, end) of the generated text, all in one phase."""

    start: int
    end: int
    phase: Phase


class ReasoningSplitter:
    """One choice's reasoning / content split, on its generated tokens."""

    def __init__(self, markers: ReasoningMarkers, prompt_ids: Sequence[int]) -> None:
        self.markers = markers
        self.reasoning = markers.opens_in(prompt_ids)
        self.reasoning_tokens = 0
        self._spans: deque[_Span] = deque()
        self._length = 0  # characters of generated text told so far
        self._released = 0  # characters handed out by `release`

    def token(self, token_id: int, piece: str) -> None:
        """One generated token and the text it decoded to (the detokenizer's piece)."""
        marker = token_id in (self.markers.start_id, self.markers.end_id)
        if self.reasoning or marker:
            self.reasoning_tokens += 1
        if not marker:
            self._extend(piece, self._phase())
            return
        # A piece may carry text held back before the marker (a split character): that text
        # belongs to the phase before it; the marker's own text (when not skipped) is dropped.
        marker_text = START_MARKER if token_id == self.markers.start_id else END_MARKER
        before = piece.removesuffix(marker_text)
        self._extend(before, self._phase())
        self._extend(piece[len(before):], Phase.MARKER)
        self.reasoning = token_id == self.markers.start_id

    def release(self, text: str) -> ReasoningSplit:
        """The parts of `text`, the next characters of the generated text to be released."""
        start, end = self._released, self._released + len(text)
        self._released = end
        reasoning: list[str] = []
        content: list[str] = []
        while self._spans and self._spans[0].start < end:
            span = self._spans[0]
            lo, hi = max(span.start, start), min(span.end, end)
            part = text[lo - start : hi - start]
            if span.phase is Phase.REASONING:
                reasoning.append(part)
            elif span.phase is Phase.CONTENT:
                content.append(part)
            if span.end > end:
                break
            self._spans.popleft()
        # Text past what the tokens told (none in practice) is in the current phase.
        rest = text[max(0, self._length - start):] if end > self._length else ""
        (reasoning if self.reasoning else content).append(rest)
        return ReasoningSplit("".join(reasoning), "".join(content))

    def _phase(self) -> Phase:
        return Phase.REASONING if self.reasoning else Phase.CONTENT

    def _extend(self, text: str, phase: Phase) -> None:
        if not text:
            return
        last = self._spans[-1] if self._spans else None
        if last is not None and last.phase is phase and last.end == self._length:
            last.end += len(text)
        else:
            self._spans.append(_Span(self._length, self._length + len(text), phase))
        self._length += len(text)
