"""Driving backends from sync tests: one event loop in a thread, and collected results."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from backends.base import Backend, GenerationEvent, GenerationRequest, SamplingParams, Usage

T = TypeVar("T")


class LoopRunner:
    """Backends bind to the loop they start on: every call for them runs on this one."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@dataclass
class Result:
    events: list[GenerationEvent] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def token_ids(self) -> list[int]:
        return [t.id for e in self.events for t in e.tokens]

    @property
    def last(self) -> GenerationEvent:
        return self.events[-1]

    @property
    def usage(self) -> Usage | None:
        return self.last.usage


async def collect(backend: Backend, req: GenerationRequest) -> Result:
    result = Result()
    async for event in backend.generate(req):
        result.events.append(event)
    return result


_ids = iter(range(10**9))


def request(
    prompt: str | None = None, messages: list[dict[str, Any]] | None = None, **sampling: Any,
) -> GenerationRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerationRequest(request_id=f"contract-{next(_ids)}", prompt=prompt,
                             messages=messages, sampling=SamplingParams(**sampling))


def wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()
