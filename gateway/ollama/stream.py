"""Ollama's streams: newline-delimited JSON (application/x-ndjson), one object a line.

The response watches for the client leaving and always closes the backend's iterator, as the
SSE response does. A failure after the stream started is one more line, `{"error": ...}`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from backends.events import close_events
from gateway.chunk_stream import StreamEnd, formatted_chunks
from gateway.generation import Generation, as_openai_error
from gateway.ollama.answer import Clock, Lines, Shape, done_reason
from gateway.ollama.errors import error_body
from gateway.openai.responses import Formatter
from gateway.sse import SSEResponse

NDJSON = "application/x-ndjson"


class NDJSONResponse(SSEResponse):
    media_type = NDJSON


def line(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, ensure_ascii=False) + "\n").encode()


async def answer_lines(gen: Generation, formatter: Formatter, shape: Shape, clock: Clock,
                       ) -> AsyncIterator[bytes]:
    """The lines of one generation (one choice), the last with done: true."""
    lines = Lines(shape)
    try:
        async with aclosing(formatted_chunks(gen, formatter)) as chunks:
            async for item in chunks:
                if isinstance(item, StreamEnd):
                    clock.mark("ended")
                    yield line(shape.done(done_reason(item.got), clock, item.usage))
                else:
                    for data in lines.chunk(item):
                        yield line(data)
    except Exception as exc:
        err = as_openai_error(exc)
        gen.trace.failed(err.failure_kind())  # the first reason given stays
        yield line(error_body(err))
    finally:
        await close_events(gen.events)
