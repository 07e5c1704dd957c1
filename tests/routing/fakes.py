"""A scriptable fake Backend and a hand-driven clock for routing's unit tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from backends.base import (
    BackendStats,
    GenerationEvent,
    GenerationRequest,
    Health,
    ModelInfo,
    RequestError,
    TokenInfo,
    Usage,
)


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeBackend:
    """Yields `tokens` events of its own `name` per choice (`n` choices, interleaved, each
    finishing on its own last event; choice `error_choice`, when set, finishes with "error");
    `fail_open` raises before the first one, `fail_after` after the first one; `gate` (when
    set) holds each request after its first event until it is set. `detokenize` spells ids
    as `<id>` pieces and refuses negative ones."""

    name: str
    tokens: int = 3
    fail_open: Exception | None = None
    fail_after: Exception | None = None
    ready: bool = True
    gate: asyncio.Event | None = None
    error_choice: int | None = None
    calls: int = 0
    closed_early: int = 0
    health_calls: int = 0
    counted: list[str] = field(default_factory=list)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def health(self) -> Health:
        self.health_calls += 1
        return Health(ready=self.ready, detail="" if self.ready else f"{self.name} is down")

    def info(self) -> ModelInfo:
        return ModelInfo(name=self.name, max_input_tokens=10, max_total_tokens=20)

    def stats(self) -> BackendStats:
        return BackendStats(running=1, kv_blocks_total=10)

    def count_tokens(self, req: GenerationRequest) -> int:
        self.counted.append(req.request_id)
        return 5

    def tokenize(self, req: GenerationRequest) -> list[int]:
        return [1, 2, 3]

    def detokenize(self, token_ids: list[int]) -> str:
        if any(t < 0 for t in token_ids):
            raise RequestError("token ids must be within the vocabulary", param="tokens")
        return "".join(f"<{t}>" for t in token_ids)

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self.calls += 1
        return self._events(req.sampling.n)

    async def _events(self, n: int) -> AsyncIterator[GenerationEvent]:
        finished = False
        try:
            if self.fail_open is not None:
                raise self.fail_open
            for i in range(self.tokens):
                last = i == self.tokens - 1
                for choice in range(n):
                    reason = "error" if choice == self.error_choice else "length"
                    yield GenerationEvent(
                        text=self.name, tokens=(TokenInfo(i, self.name),),
                        finish_reason=reason if last else None,
                        usage=Usage(5, self.tokens) if last else None, index=choice)
                    finished = last and choice == n - 1
                if i == 0 and self.fail_after is not None:
                    raise self.fail_after
                if i == 0 and self.gate is not None:
                    await self.gate.wait()
        finally:
            if not finished:
                self.closed_early += 1
