"""Driving an opened generation into a response: whole, or as typed server-sent events.

A stream is `response.created`, `response.in_progress`, the output items' events (output.py),
then `response.completed` or `response.incomplete`; each event is sent as
`event: <type>` + `data: <JSON>` and numbered by `sequence_number`. A failure after the stream
started is an `error` event (OpenAI's code and message) then `response.failed`. Either way
the generation's iterator is closed at the end, which is how the backend learns to stop.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from backends.base import ReasoningSplit, Usage
from backends.events import close_events
from gateway.errors import OpenAIError
from gateway.generation import Choices, Collected, Generation, as_openai_error, gather_choices
from gateway.responses_api.output import OutputBuilder
from gateway.responses_api.response import ResponseHead, finished_status
from gateway.responses_api.translate import renamed

JSON = dict[str, Any]
# (status, output items, usage) -> the final response object, once stored.
Finish = Callable[[str, list[JSON], Usage], Awaitable[JSON]]


class _Frames:
    """SSE frames, numbered in order."""

    def __init__(self) -> None:
        self._next = 0

    def of(self, event: JSON) -> bytes:
        event = {**event, "sequence_number": self._next}
        self._next += 1
        data = json.dumps(event, ensure_ascii=False)
        return f"event: {event['type']}\ndata: {data}\n\n".encode()


def replay(builder: OutputBuilder, choice: Collected) -> None:
    """Feed a whole choice to `builder` event by event, as a stream of it would have been."""
    if choice.content is None:
        for piece in choice.text:
            builder.feed(piece)
        return
    builder.feed("", ReasoningSplit("".join(choice.reasoning or ()), ""))
    for piece in choice.content:
        builder.feed(piece)


async def whole(gen: Generation, builder: OutputBuilder, finish: Finish) -> JSON:
    got, usage = await gather_choices(gen)
    choice = got.items[0]
    replay(builder, choice)
    status = finished_status(choice.finish_reason)
    builder.finish(status)
    return await finish(status, builder.items, usage)


def _failed(frames: _Frames, head: ResponseHead, err: OpenAIError) -> list[bytes]:
    err = renamed(err)
    code = "rate_limit_exceeded" if err.status_code == 429 else "server_error"
    return [
        frames.of({"type": "error", "code": err.code, "message": err.message,
                   "param": err.param}),
        frames.of({"type": "response.failed", "response": head.body(
            "failed", error={"code": code, "message": err.message})}),
    ]


async def streamed(gen: Generation, head: ResponseHead, builder: OutputBuilder,
                   finish: Finish) -> AsyncIterator[bytes]:
    frames = _Frames()
    try:
        yield frames.of({"type": "response.created", "response": head.body("in_progress")})
        yield frames.of({"type": "response.in_progress", "response": head.body("in_progress")})
        got = Choices(1)
        event = gen.first
        while event is not None:
            done = got.add(gen, event)
            for item_event in builder.feed(event.text, event.split):
                yield frames.of(item_event)
            if done or got.failure() is not None:
                break
            event = await anext(gen.events, None)
        err = got.failure_error(gen.request.request_id)
        if err is not None:
            gen.trace.failed(err.failure_kind())
            for frame in _failed(frames, head, err):
                yield frame
            return
        usage = got.usage(gen)
        last = got.last()
        gen.trace.finished(usage, last.timings if last else None)
        status = finished_status(got.items[0].finish_reason)
        for item_event in builder.finish(status):
            yield frames.of(item_event)
        response = await finish(status, builder.items, usage)
        yield frames.of({"type": f"response.{status}", "response": response})
    except Exception as exc:
        err = as_openai_error(exc)
        gen.trace.failed(err.failure_kind())
        for frame in _failed(frames, head, err):
            yield frame
    finally:
        await close_events(gen.events)
