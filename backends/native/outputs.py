"""What the engine reports for each choice: streamed text, token infos, prompt logprobs and,
once it finishes, its timings and seed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backends.base import ReasoningSplit, RequestTimings, TokenInfo, TopLogprob
from backends.native.sampling.logprobs import prompt_token_infos
from backends.native.scheduling.sequence import OutputState, Sequence
from backends.text.detokenizer import IncrementalDetokenizer
from backends.text.reasoning import ReasoningSplitter
from backends.text.stop_checker import StopChecker
from backends.text.token_texts import TokenTexts
from backends.text.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    """What one step produced for one choice (`index`) of a request."""

    request_id: str
    text: str
    tokens: list[TokenInfo]
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: RequestTimings | None = None
    seed: int | None = None
    index: int = 0
    # The prompt's tokens with logprobs (prompt_logprobs asked): on choice 0's first output.
    prompt_token_infos: list[TokenInfo] | None = None
    # A thinking model's `text` split into reasoning and content, and (once finished) its
    # reasoning tokens; None for a model that does not reason.
    split: ReasoningSplit | None = None
    reasoning_tokens: int | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (once finished)
    stop_sequence: str | None = None  # the stop string that ended it
    # An embedding model's input, once pooled: its float32 vector (native/embedding.py).
    embedding: np.ndarray | None = None


class ChoiceOutputs:
    """Turns each choice's tokens into text and token infos through its OutputState."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)

    def start(self, seq: Sequence) -> None:
        markers = self.tokenizer.reasoning_markers
        seq.output = OutputState(
            IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids),
            StopChecker(seq.sampling.stop),
            reasoning=None if markers is None else ReasoningSplitter(markers,
                                                                     seq.prompt_token_ids),
        )

    def token(
        self, seq: Sequence, token: int, logprob: float | None, top: list[tuple[int, float]],
    ) -> tuple[TokenInfo, str, bool]:
        """The info of a token just appended, the text it releases, and whether that text
        completed a stop string."""
        state = _state(seq)
        piece = state.detokenizer.add(token)
        if state.reasoning is not None:
            state.reasoning.token(token, piece)
        text, stopped = state.stops.feed(piece)
        logprobs = seq.sampling.logprobs
        info = TokenInfo(
            token, piece, logprob if logprobs else None, self.tokenizer.is_special(token),
            self._alternatives(top, token, piece) if logprobs else (),
        )
        return info, text, stopped

    def record_prompt_logprobs(
        self, logits: torch.Tensor, spans: list[tuple[Sequence, int, int]],
    ) -> None:
        """Record the logprobs of the prompt tokens this step's extra logits rows predict
        (by position: a recompute after preemption overwrites them with the same values)."""
        offset = 0
        for seq, first, count in spans:
            targets = seq.prompt_token_ids[first + 1 : first + 1 + count]
            infos = prompt_token_infos(
                logits[offset : offset + count], targets, seq.sampling.prompt_logprobs or 0,
                self.token_texts, self.tokenizer.is_special,
            )
            offset += count
            known = _state(seq).prompt_logprobs
            known.update(zip(range(first + 1, first + 1 + count), infos, strict=True))

    def take_prompt_infos(self, seq: Sequence) -> list[TokenInfo]:
        state = _state(seq)
        known, state.prompt_logprobs = state.prompt_logprobs, {}
        first = seq.prompt_token_ids[0]
        head = TokenInfo(first, self.token_texts(first), None, self.tokenizer.is_special(first))
        return [head] + [known[p] for p in range(1, seq.num_prompt_tokens)]

    def _alternatives(
        self, top: list[tuple[int, float]], token: int, piece: str,
    ) -> tuple[TopLogprob, ...]:
        """The alternatives' single-token texts, except that the chosen token's own entry
        reads as the chosen token does. Its text stays the detokenizer's piece ("" for a
        token ending mid-character, no special tokens when they are skipped): TGI streams and
        joins token texts into the generated text, which single-token decodes would garble
        (a SentencePiece word loses its leading space, a split character turns into U+FFFD)."""
        return tuple(
            TopLogprob(alt.id, piece if alt.id == token else alt.text, alt.logprob)
            for alt in self.token_texts.top(top)
        )


def held_text(seq: Sequence) -> str:
    """The text held back for a possible stop string, at the end of a choice."""
    return _state(seq).stops.flush()


def request_output(seq: Sequence, text: str, tokens: list[TokenInfo],
                   embedding: np.ndarray | None = None) -> RequestOutput:
    output = RequestOutput(
        seq.group_id, text, tokens, seq.is_finished, seq.finish_reason, seq.stop_reason,
        seq.num_prompt_tokens, seq.num_output_tokens, index=seq.index, embedding=embedding,
    )
    splitter = seq.output.reasoning if seq.output is not None else None
    if splitter is not None:
        output.split = splitter.release(text)
    if seq.is_finished:
        output.timings = _timings(seq)
        output.seed = seq.seed
        output.cached_tokens = seq.cached_tokens
        output.stop_sequence = seq.output.stops.matched if seq.output is not None else None
        output.reasoning_tokens = None if splitter is None else splitter.reasoning_tokens
    return output


def _state(seq: Sequence) -> OutputState:
    assert seq.output is not None, "the engine starts every choice's output state"
    return seq.output


def _timings(seq: Sequence) -> RequestTimings:
    finished = seq.finished_at
    assert finished is not None, "timings are of finished choices"
    started = finished if seq.first_scheduled is None else seq.first_scheduled
    return RequestTimings(
        queue_seconds=max(0.0, started - seq.arrival_time),
        inference_seconds=max(0.0, finished - started),
    )
