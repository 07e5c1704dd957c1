"""A Backend wrapper that records how each generation ended: finished, or closed early."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from backends.base import Backend, GenerationEvent, GenerationRequest


@dataclass
class Recording:
    inner: Backend
    finished: int = 0
    closed_early: int = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        return self._generate(req)

    async def _generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        done = False
        events = self.inner.generate(req)
        try:
            async for event in events:
                done = event.finish_reason is not None
                yield event
        finally:
            await events.aclose()  # type: ignore[attr-defined]
            if done:
                self.finished += 1
            else:
                self.closed_early += 1
