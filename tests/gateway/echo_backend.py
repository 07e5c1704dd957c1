"""A small deterministic Backend for gateway tests (no model, no torch).

Tokens are whitespace-separated words. It generates words from a fixed list,
stops naturally after `natural_length` words (finish "stop") unless `ignore_eos`,
honours `max_tokens` (finish "length") and stop strings, and refuses requests
whose prompt + max_tokens exceed `max_total_tokens` with a RequestError on the
first `__anext__`, as the contract says. Prompts with magic words misbehave on
purpose: FAIL_MIDWAY raises after two tokens, ABORT_NOW finishes with "abort",
UNAVAILABLE raises BackendUnavailable.

Deterministic fake values for the OpenAI extras:
- `n`: choice k (its events carry `index=k`) says WORDS[(i + k) % 10] as its i-th word, so
  the choices differ, and stops naturally after `max(natural_length - k, 1)` words, so they
  finish at different times. The choices' events interleave round-robin (one word of each
  choice per round); each choice's last event has its finish reason and usage (the prompt's
  words, that choice's words).
- token ids: a word's id is its position in WORDS; every generated token's logprob is -0.5
  (whether or not logprobs were asked).
- `top_logprobs` k (with `logprobs`): the chosen token first (-0.5), then the next k - 1
  words of WORDS after it, cyclically, at -1.5, -2.5, ...; each alternative's text spelled
  like the chosen piece (a leading space after the first word).
- `prompt_logprobs` k: on choice 0's first event, one TokenInfo per prompt word (id = its
  position in the prompt, text = the word with a leading space after the first, logprob None
  for the first and -1.0 after), each with k alternatives: itself (-1.0) then WORDS[0..k-2]
  at -2.0, -3.0, ...
- `detokenize(ids)`: the words WORDS[id] joined by spaces; an id outside 0..9 is a
  RequestError (param "tokens").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from backends.base import (
    BackendStats,
    BackendUnavailable,
    GenerationEvent,
    GenerationRequest,
    Health,
    ModelInfo,
    RequestError,
    TokenInfo,
    TopLogprob,
    Usage,
)

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa")


def prompt_text(req: GenerationRequest) -> str:
    if req.messages is not None:
        # An assistant message that only calls tools has no content.
        return " ".join(str(m.get("content") or "") for m in req.messages)
    return req.prompt or ""


@dataclass
class EchoBackend:
    name: str = "echo"
    max_total_tokens: int = 64
    natural_length: int = 8
    delay_s: float = 0.0
    ready: bool = True
    started: bool = False
    closed: bool = False
    requests: list[GenerationRequest] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    running: int = 0

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def health(self) -> Health:
        return Health(ready=self.ready, detail="" if self.ready else "loading")

    def info(self) -> ModelInfo:
        return ModelInfo(name=self.name, max_input_tokens=self.max_total_tokens - 1,
                         max_total_tokens=self.max_total_tokens, backend="echo")

    def stats(self) -> BackendStats:
        return BackendStats(queue_size=0, running=self.running, kv_blocks_used=3,
                            kv_blocks_total=10)

    def count_tokens(self, req: GenerationRequest) -> int:
        if req.prompt_token_ids is not None:
            return len(req.prompt_token_ids)
        return len(prompt_text(req).split())

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self.requests.append(req)
        return self._generate(req)

    def _budget(self, req: GenerationRequest, prompt_tokens: int) -> int:
        limit = req.sampling.max_tokens
        if limit is None:
            return max(self.max_total_tokens - prompt_tokens, 0)
        if prompt_tokens + limit > self.max_total_tokens:
            raise RequestError(
                f"This model's maximum context length is {self.max_total_tokens} tokens; "
                f"you requested {prompt_tokens + limit} ({prompt_tokens} in the prompt).",
                param="max_tokens", code="context_length_exceeded",
            )
        return limit

    def detokenize(self, token_ids: list[int]) -> str:
        if any(not 0 <= t < len(WORDS) for t in token_ids):
            raise RequestError("token ids must be within the vocabulary (0-9)", param="tokens")
        return " ".join(WORDS[t] for t in token_ids)

    async def _generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        text = prompt_text(req)
        if "UNAVAILABLE" in text:
            raise BackendUnavailable("echo is restarting")
        prompt_tokens = self.count_tokens(req)
        budget = self._budget(req, prompt_tokens)
        choices = [self._choice(req, k, budget, prompt_tokens, "ABORT_NOW" in text)
                   for k in range(max(req.sampling.n, 1))]
        if req.sampling.prompt_logprobs is not None and choices[0]:
            first = choices[0][0]
            choices[0][0] = replace(first, prompt_tokens=_prompt_infos(
                text, req.sampling.prompt_logprobs))
        finished = False
        self.running += 1
        try:
            for step in range(max(len(events) for events in choices)):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if "FAIL_MIDWAY" in text and step == 2:
                    raise RuntimeError("echo exploded")
                for events in choices:
                    if step < len(events):
                        yield events[step]
            finished = True
        finally:
            self.running -= 1
            (self.completed if finished else self.aborted).append(req.request_id)

    def _choice(
        self, req: GenerationRequest, k: int, budget: int, prompt_tokens: int, abort: bool,
    ) -> list[GenerationEvent]:
        """Every event of choice `k`, its last one finishing."""
        natural = max(self.natural_length - k, 1)
        length = budget if req.sampling.ignore_eos else min(budget, natural)
        events: list[GenerationEvent] = []
        out = ""
        for i in range(length):
            word = (i + k) % len(WORDS)
            piece = (" " if i else "") + WORDS[word]
            stop = next((s for s in req.sampling.stop if s in out + piece), None)
            if stop is not None:
                cut = (out + piece).index(stop)
                events.append(self._last(out + piece, cut, len(out), i, prompt_tokens, "stop",
                                         k))
                return events
            out += piece
            token = TokenInfo(id=word, text=piece, logprob=-0.5,
                              top_logprobs=_alternatives(req, word, i))
            if i == length - 1:
                reason = "abort" if abort else ("length" if length == budget else "stop")
                events.append(GenerationEvent(text=piece, tokens=(token,), finish_reason=reason,
                                              usage=Usage(prompt_tokens, i + 1), index=k))
                return events
            events.append(GenerationEvent(text=piece, tokens=(token,), index=k))
        return [GenerationEvent(finish_reason="length", usage=Usage(prompt_tokens, 0), index=k)]

    @staticmethod
    def _last(
        full: str, cut: int, before: int, index: int, prompt_tokens: int, reason: str,
        choice: int,
    ) -> GenerationEvent:
        return GenerationEvent(text=full[before:cut], finish_reason=reason,  # type: ignore[arg-type]
                               usage=Usage(prompt_tokens, index + 1), stop_reason="stop_sequence",
                               index=choice)


def _alternatives(req: GenerationRequest, word: int, position: int) -> tuple[TopLogprob, ...]:
    k = req.sampling.top_logprobs if req.sampling.logprobs else 0
    space = " " if position else ""
    return tuple(TopLogprob(id=(word + j) % len(WORDS), text=space + WORDS[(word + j) % len(WORDS)],
                            logprob=-0.5 - j) for j in range(k))


def _prompt_infos(text: str, k: int) -> tuple[TokenInfo, ...]:
    infos = []
    for i, word in enumerate(text.split()):
        piece = (" " if i else "") + word
        alternatives = (TopLogprob(i, piece, -1.0),) + tuple(
            TopLogprob(j, WORDS[j], -2.0 - j) for j in range(k - 1))
        infos.append(TokenInfo(id=i, text=piece, logprob=None if i == 0 else -1.0,
                               top_logprobs=alternatives[:k]))
    return tuple(infos)
