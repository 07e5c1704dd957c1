"""Driving one backend generation: open it, collect it, stream it, always close it.

`open_generation` pulls the first event before any response starts, so a
`RequestError` (prompt too long, ...) becomes a real 4xx even for streams. Every
path ends in `close_events`, which `aclose()`s the backend's iterator under a
cancellation shield: that is how the backend learns to abort and free the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from starlette.types import Receive

from backends.base import (
    Backend,
    GenerationEvent,
    GenerationRequest,
    ReasoningSplit,
    TokenInfo,
    Usage,
)
from backends.events import close_events
from gateway.errors import OpenAIError, internal_error, to_openai_error
from gateway.metrics import GenerationTrace
from gateway.openai.responses import Formatter

log = logging.getLogger("switchyard.gateway")
T = TypeVar("T")
Events = AsyncIterator[GenerationEvent]


class ClientDisconnected(Exception):
    """The client went away before its (non-streamed) response was ready."""


@dataclass
class Generation:
    """An opened backend generation: its iterator and the first event already pulled."""

    backend: Backend
    request: GenerationRequest
    events: Events
    first: GenerationEvent | None
    trace: GenerationTrace


@dataclass
class Collected:
    """One choice's events folded together."""

    index: int = 0
    text: list[str] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    last: GenerationEvent | None = None  # the finishing event (stop_reason, seed, timings)
    seen: bool = False  # any event arrived for this choice
    # A thinking model's text, split (`text` stays as generated): None for other models.
    reasoning: list[str] | None = None
    content: list[str] | None = None

    def add(self, event: GenerationEvent) -> bool:
        """Fold one event in; True when it finished this choice."""
        self.seen = True
        self.text.append(event.text)
        self.tokens.extend(event.tokens)
        if event.split is not None:
            self._add_split(event.split)
        elif self.content is not None:  # an upstream's answer after its reasoning
            self.content.append(event.text)
        if event.finish_reason is None:
            return False
        self.finish_reason = event.finish_reason
        self.usage = event.usage
        self.last = event
        return True

    def _add_split(self, split: ReasoningSplit) -> None:
        if self.reasoning is None or self.content is None:
            # What came before without a split was content (an upstream's, say).
            self.reasoning, self.content = [], self.text[:-1]
        self.reasoning.append(split.reasoning)
        self.content.append(split.content)

    def completion_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage is not None else len(self.tokens)

    def reasoning_tokens(self) -> int | None:
        return self.usage.reasoning_tokens if self.usage is not None else None


class Choices:
    """Every choice of a generation (`n` of them), their events interleaved."""

    def __init__(self, n: int) -> None:
        self.items = [Collected(index=i) for i in range(n)]
        self.prompt_tokens: tuple[TokenInfo, ...] | None = None
        self._finished = 0

    def add(self, gen: Generation, event: GenerationEvent) -> bool:
        """Fold one event in; True once every choice has finished."""
        gen.trace.event(bool(event.text or event.tokens))
        if not 0 <= event.index < len(self.items):
            raise RuntimeError(f"backend sent choice {event.index} of {len(self.items)}")
        if event.prompt_tokens is not None:
            self.prompt_tokens = event.prompt_tokens
        if self.items[event.index].add(event):
            self._finished += 1
        return self._finished == len(self.items)

    def failure(self) -> str | None:
        """"abort" or "error" when a choice ended so (the whole request fails then)."""
        failed = self.failed()
        return failed.finish_reason if failed is not None else None

    def failed(self) -> Collected | None:
        """The first choice that ended with "abort" or "error"."""
        return next((c for c in self.items if c.finish_reason in ("abort", "error")), None)

    def failure_error(self, request_id: str) -> OpenAIError | None:
        """The error a failed choice becomes, or None when none failed."""
        failed = self.failed()
        if failed is None or failed.finish_reason is None:
            return None
        stop_reason = failed.last.stop_reason if failed.last is not None else None
        return finish_error(failed.finish_reason, stop_reason, request_id)

    def last(self) -> GenerationEvent | None:
        return next((c.last for c in self.items if c.last is not None), None)

    def usage(self, gen: Generation) -> Usage:
        """The prompt's tokens once, plus every choice's completion tokens."""
        if len(self.items) > 1 and not all(c.seen for c in self.items):
            log.error("backend ended a generation with choices missing")
            raise finish_error("error")
        finals = [c.usage for c in self.items if c.usage is not None]
        # The contract puts usage on the last event; recount if a backend forgot.
        prompt = finals[0].prompt_tokens if finals else gen.backend.count_tokens(gen.request)
        cached = finals[0].cached_tokens if finals else 0  # the choices share one prompt
        reasoning = [r for r in (c.reasoning_tokens() for c in self.items) if r is not None]
        return Usage(prompt, sum(c.completion_tokens() for c in self.items),
                     sum(reasoning) if reasoning else None, cached)


def as_openai_error(exc: Exception) -> OpenAIError:
    """Backend exceptions -> HTTP errors; anything unexpected is a logged server error."""
    err = to_openai_error(exc)
    if err is None:
        log.error("backend generation failed", exc_info=exc)
        return internal_error()
    return err


async def open_generation(
    backend: Backend, request: GenerationRequest, trace: GenerationTrace,
) -> Generation:
    events: Events | None = None
    try:
        events = backend.generate(request)
        first = await anext(events, None)
    except BaseException as exc:
        if events is not None:
            await close_events(events)
        if isinstance(exc, Exception):
            raise as_openai_error(exc) from exc
        raise
    return Generation(backend, request, events, first, trace)


def finish_error(reason: str, stop_reason: str | None = None,
                 request_id: str | None = None) -> OpenAIError:
    """The error of a generation that ended with "abort" or "error" (the backend's
    `stop_reason` says why when it knows: a deadline)."""
    if stop_reason == "request_timeout":
        return OpenAIError(504, "The request took longer than the server's request timeout "
                           "(--request-timeout) and was stopped.", code="request_timeout",
                           error_type="timeout_error")
    if stop_reason == "queue_timeout":
        return OpenAIError(503, "The request waited longer than the server's queue timeout "
                           "(--queue-timeout); try again later.", code="queue_timeout",
                           headers={"Retry-After": "1"})
    if reason == "abort":
        return OpenAIError(503, "The request was aborted by the server; try again.",
                           code="request_aborted", headers={"Retry-After": "1"})
    which = f" request {request_id}" if request_id else ""
    return OpenAIError(500, f"The model failed while generating{which}.",
                       error_type="api_error", code="generation_error")


async def gather_choices(gen: Generation) -> tuple[Choices, Usage]:
    """Every event of a non-streamed generation, by choice, and the usage of them all
    (recorded in the metrics once)."""
    got = Choices(gen.request.sampling.n)
    try:
        event = gen.first
        while event is not None and not got.add(gen, event):
            event = await anext(gen.events, None)
    except Exception as exc:
        raise as_openai_error(exc) from exc
    finally:
        await close_events(gen.events)
    failure = got.failure_error(gen.request.request_id)
    if failure is not None:
        raise failure
    usage = got.usage(gen)
    last = got.last()
    gen.trace.finished(usage, last.timings if last else None)
    return got, usage


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


async def stream(gen: Generation, formatter: Formatter) -> AsyncIterator[bytes]:
    """SSE frames: opening chunks, deltas and each choice's finish chunk, the usage chunk,
    `[DONE]`.

    A failure after the response started cannot change the status any more; it is
    sent as an `{"error": ...}` event (which the OpenAI SDK raises), then `[DONE]`.
    """
    try:
        for chunk in formatter.opening_chunks():
            yield sse(chunk)
        got = Choices(gen.request.sampling.n)
        event = gen.first
        while event is not None:
            done = got.add(gen, event)
            for chunk in formatter.delta_chunks(event.index, event.text, event.tokens,
                                                event.split):
                yield sse(chunk)
            if got.failure() is not None:
                break
            if event.finish_reason is not None:
                for chunk in formatter.finish_chunks(event.index, event.finish_reason):
                    yield sse(chunk)
            if done:
                break
            event = await anext(gen.events, None)
        async for frame in _stream_end(gen, formatter, got):
            yield frame
    except Exception as exc:
        err = as_openai_error(exc)
        gen.trace.failed(err.failure_kind())
        yield sse(err.body())
    finally:
        await close_events(gen.events)
    yield sse("[DONE]")


async def _stream_end(gen: Generation, formatter: Formatter, got: Choices,
                      ) -> AsyncIterator[bytes]:
    err = got.failure_error(gen.request.request_id)
    if err is not None:
        gen.trace.failed(err.failure_kind())
        yield sse(err.body())
        return
    usage = got.usage(gen)
    for choice in got.items:  # the iterator ended without finishing these: a plain stop
        if choice.finish_reason is None:
            for chunk in formatter.finish_chunks(choice.index, "stop"):
                yield sse(chunk)
    last = got.last()
    gen.trace.finished(usage, last.timings if last else None)
    if formatter.include_usage:
        yield sse(formatter.usage_chunk(usage))


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (and raising ClientDisconnected) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for pending in (task, watcher):
            pending.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, watcher, return_exceptions=True)
