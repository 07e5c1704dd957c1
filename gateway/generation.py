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

from backends.base import Backend, GenerationEvent, GenerationRequest, TokenInfo, Usage
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
    text: list[str] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    last: GenerationEvent | None = None  # the finishing event (stop_reason, seed, timings)


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


def finish_error(reason: str) -> OpenAIError:
    if reason == "abort":
        return OpenAIError(503, "The request was aborted by the server; try again.",
                           code="request_aborted", headers={"Retry-After": "1"})
    return OpenAIError(500, "The model failed while generating.", error_type="api_error",
                       code="generation_error")


def observe(gen: Generation, event: GenerationEvent, into: Collected) -> bool:
    """Fold one event into `into`; True when it was the last one."""
    gen.trace.event(bool(event.text or event.tokens))
    into.text.append(event.text)
    into.tokens.extend(event.tokens)
    if event.finish_reason is None:
        return False
    into.finish_reason = event.finish_reason
    into.usage = event.usage
    into.last = event
    return True


def final_usage(gen: Generation, got: Collected) -> Usage:
    if got.usage is not None:
        return got.usage
    # The contract puts usage on the last event; recount if a backend forgot.
    return Usage(gen.backend.count_tokens(gen.request), len(got.tokens))


async def gather(gen: Generation) -> tuple[Collected, Usage]:
    """Every event of a non-streamed generation, and its usage (recorded in the metrics)."""
    got = Collected()
    try:
        event = gen.first
        while event is not None and not observe(gen, event, got):
            event = await anext(gen.events, None)
    except Exception as exc:
        raise as_openai_error(exc) from exc
    finally:
        await close_events(gen.events)
    reason = got.finish_reason or "stop"
    if reason in ("abort", "error"):
        raise finish_error(reason)
    usage = final_usage(gen, got)
    gen.trace.finished(usage, got.last.timings if got.last else None)
    return got, usage


async def collect(gen: Generation, formatter: Formatter) -> dict[str, Any]:
    """The whole non-streamed response body."""
    got, usage = await gather(gen)
    return formatter.body("".join(got.text), got.tokens, got.finish_reason or "stop", usage)


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


async def stream(gen: Generation, formatter: Formatter, *, logprobs: bool) -> AsyncIterator[bytes]:
    """SSE frames: opening chunks, deltas, the finish chunk, the usage chunk, `[DONE]`.

    A failure after the response started cannot change the status any more; it is
    sent as an `{"error": ...}` event (which the OpenAI SDK raises), then `[DONE]`.
    """
    try:
        for chunk in formatter.opening_chunks():
            yield sse(chunk)
        got = Collected()
        event = gen.first
        while event is not None:
            last = observe(gen, event, got)
            if event.text or (logprobs and event.tokens):
                yield sse(formatter.delta_chunk(event.text, event.tokens))
            if last:
                break
            event = await anext(gen.events, None)
        reason = got.finish_reason or "stop"
        if reason in ("abort", "error"):
            err = finish_error(reason)
            gen.trace.failed(err.failure_kind())
            yield sse(err.body())
        else:
            usage = final_usage(gen, got)
            gen.trace.finished(usage, got.last.timings if got.last else None)
            yield sse(formatter.finish_chunk(reason))
            if formatter.include_usage:
                yield sse(formatter.usage_chunk(usage))
    except Exception as exc:
        err = as_openai_error(exc)
        gen.trace.failed(err.failure_kind())
        yield sse(err.body())
    finally:
        await close_events(gen.events)
    yield sse("[DONE]")


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
