"""A generation as its formatter's chunks, for routes that stream in a format of their own
(Anthropic's events, Ollama's lines) made from the chat completion's chunks.

The same walk as OpenAI's stream (gateway/generation.py): each event's delta chunks, each
choice's finish chunks (a stop for a choice the backend left unfinished), the usage once
every choice is done, the trace told how it ended, the backend's iterator always closed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from backends.base import Usage
from backends.events import close_events
from gateway.generation import Choices, Generation, as_openai_error
from gateway.openai.responses import Formatter

JSON = dict[str, Any]


@dataclass(frozen=True)
class StreamEnd:
    """The generation finished: its choices and their usage."""

    got: Choices
    usage: Usage


async def formatted_chunks(gen: Generation, formatter: Formatter,
                           ) -> AsyncIterator[JSON | StreamEnd]:
    """The formatter's chunks as the events arrive, then a `StreamEnd`. A failure (the
    backend's, or a choice that ended in "abort" or "error") raises the `OpenAIError` it
    answers as, once recorded in the trace."""
    try:
        got = Choices(gen.request.sampling.n)
        event = gen.first
        while event is not None:
            done = got.add(gen, event)
            for chunk in formatter.delta_chunks(event.index, event.text, event.tokens,
                                                event.split):
                yield chunk
            if got.failure() is not None:
                break
            if event.finish_reason is not None:
                for chunk in formatter.finish_chunks(event.index, event.finish_reason):
                    yield chunk
            if done:
                break
            event = await anext(gen.events, None)
        failure = got.failure_error(gen.request.request_id)
        if failure is not None:
            raise failure
        usage = got.usage(gen)
        for choice in got.items:
            if choice.finish_reason is None:
                for chunk in formatter.finish_chunks(choice.index, "stop"):
                    yield chunk
        last = got.last()
        gen.trace.finished(usage, last.timings if last else None)
        yield StreamEnd(got, usage)
    except Exception as exc:
        err = as_openai_error(exc)
        gen.trace.failed(err.failure_kind())
        raise err from None
    finally:
        await close_events(gen.events)
