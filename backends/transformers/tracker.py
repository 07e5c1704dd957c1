"""RequestTracker: one request's output side — detokenization, stops, finish, usage, timings.

Fed one generated token at a time (from the generate thread); hands each GenerationEvent to
`publish`. The same rules as the native engine: stop strings are trimmed and win over EOS,
EOS (unless ignored) and `stop_token_ids` stop, `max_tokens` ends with "length".
"""

from __future__ import annotations

import time
from collections.abc import Callable

from backends.base import GenerationEvent, RequestTimings, SamplingParams, TokenInfo, Usage
from backends.text.detokenizer import IncrementalDetokenizer
from backends.text.reasoning import ReasoningSplitter
from backends.text.stop_checker import StopChecker
from backends.text.token_texts import TokenTexts
from backends.text.tokenizer import Tokenizer


class RequestTracker:
    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], sampling: SamplingParams,
        max_tokens: int, seed: int | None, publish: Callable[[GenerationEvent], None],
        index: int = 0, texts: TokenTexts | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._texts = texts or TokenTexts(tokenizer)
        self.index = index  # which of the request's choices this is (0 .. n-1)
        self._sampling = sampling
        self._num_prompt = len(prompt_ids)
        self.max_tokens = max_tokens
        self.seed = seed
        self._publish = publish
        eos = frozenset() if sampling.ignore_eos else tokenizer.eos_token_ids
        self.stop_ids = eos | frozenset(sampling.stop_token_ids)
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops = StopChecker(sampling.stop)
        markers = tokenizer.reasoning_markers
        self._reasoning = None if markers is None else ReasoningSplitter(markers, prompt_ids)
        self.num_generated = 0
        self.finished = False
        self._arrival = time.monotonic()
        self._started: float | None = None

    def start(self) -> None:
        """The worker begins this request's `generate` (the end of its queueing)."""
        self._started = time.monotonic()

    def add(
        self, token: int, logprob: float | None, top: list[tuple[int, float]] | None = None,
    ) -> bool:
        """One generated token (with its raw logprob and the most likely alternatives);
        publishes its event; True once the request is finished."""
        self.num_generated += 1
        piece = self._detokenizer.add(token)
        if self._reasoning is not None:
            self._reasoning.token(token, piece)
        text, stopped = self._stops.feed(piece)
        asked = self._sampling.logprobs
        info = TokenInfo(
            token, piece, logprob if asked else None, self._tokenizer.is_special(token),
            self._texts.top(top) if asked and top else (),
        )
        reason: str | None = None
        stop_reason: str | None = None
        if stopped:
            reason, stop_reason = "stop", "stop_sequence"
        elif token in self.stop_ids:
            reason, stop_reason = "stop", "eos_token"
        elif self.num_generated >= self.max_tokens:
            reason = "length"
        if reason is not None and not stopped:
            text += self._stops.flush()
        self._emit(text, (info,), reason, stop_reason)
        return self.finished

    def finish(self, reason: str) -> None:
        """End a request that `add` did not finish (an error, or generate stopping early)."""
        if not self.finished:
            self._emit(self._stops.flush() if reason == "length" else "", (), reason, None)

    def _emit(
        self, text: str, tokens: tuple[TokenInfo, ...], reason: str | None,
        stop_reason: str | None,
    ) -> None:
        final = reason is not None
        self.finished = final
        splitter = self._reasoning
        reasoning_tokens = None if splitter is None else splitter.reasoning_tokens
        self._publish(GenerationEvent(
            text=text,
            tokens=tokens,
            finish_reason=reason,  # type: ignore[arg-type]
            usage=Usage(self._num_prompt, self.num_generated, reasoning_tokens) if final else None,
            split=None if splitter is None else splitter.release(text),
            stop_reason=stop_reason,
            stop_sequence=self._stops.matched if final else None,
            timings=self._timings() if final else None,
            seed=self.seed if final else None,
            index=self.index,
        ))

    def _timings(self) -> RequestTimings:
        now = time.monotonic()
        started = self._started if self._started is not None else now
        return RequestTimings(
            queue_seconds=max(0.0, started - self._arrival),
            inference_seconds=max(0.0, now - started),
        )
