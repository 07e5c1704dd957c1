"""A small deterministic Backend for gateway tests (no model, no torch).

Tokens are whitespace-separated words. It generates words from a fixed list,
stops naturally after `natural_length` words (finish "stop") unless `ignore_eos`,
honours `max_tokens` (finish "length") and stop strings, and refuses requests
whose prompt + max_tokens exceed `max_total_tokens` with a RequestError on the
first `__anext__`, as the contract says. Prompts with magic words misbehave on
purpose: FAIL_MIDWAY raises after two tokens, ABORT_NOW finishes with "abort",
UNAVAILABLE raises BackendUnavailable.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from backends.base import (
    BackendStats,
    BackendUnavailable,
    GenerationEvent,
    GenerationRequest,
    Health,
    ModelInfo,
    RequestError,
    TokenInfo,
    Usage,
)

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa")


def prompt_text(req: GenerationRequest) -> str:
    if req.messages is not None:
        return " ".join(str(m["content"]) for m in req.messages)
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

    async def _generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        text = prompt_text(req)
        if "UNAVAILABLE" in text:
            raise BackendUnavailable("echo is restarting")
        prompt_tokens = self.count_tokens(req)
        budget = self._budget(req, prompt_tokens)
        length = budget if req.sampling.ignore_eos else min(budget, self.natural_length)
        finished = False
        self.running += 1
        try:
            out = ""
            for i in range(length):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if "FAIL_MIDWAY" in text and i == 2:
                    raise RuntimeError("echo exploded")
                piece = (" " if i else "") + WORDS[i % len(WORDS)]
                stop = next((s for s in req.sampling.stop if s in out + piece), None)
                if stop is not None:
                    cut = (out + piece).index(stop)
                    finished = True
                    yield self._last(out + piece, cut, len(out), i, prompt_tokens, "stop")
                    return
                out += piece
                token = TokenInfo(id=i % len(WORDS), text=piece, logprob=-0.5)
                if i == length - 1:
                    finished = True
                    reason = "abort" if "ABORT_NOW" in text else (
                        "length" if length == budget else "stop")
                    yield GenerationEvent(text=piece, tokens=(token,), finish_reason=reason,
                                          usage=Usage(prompt_tokens, i + 1))
                    return
                yield GenerationEvent(text=piece, tokens=(token,))
            finished = True
            yield GenerationEvent(finish_reason="length", usage=Usage(prompt_tokens, 0))
        finally:
            self.running -= 1
            (self.completed if finished else self.aborted).append(req.request_id)

    @staticmethod
    def _last(
        full: str, cut: int, before: int, index: int, prompt_tokens: int, reason: str,
    ) -> GenerationEvent:
        return GenerationEvent(text=full[before:cut], finish_reason=reason,  # type: ignore[arg-type]
                               usage=Usage(prompt_tokens, index + 1), stop_reason="stop_sequence")
