"""Anthropic's message stream: `message_start`, `ping`, content blocks (`content_block_start`,
`content_block_delta` with `thinking_delta` / `text_delta` / `input_json_delta`,
`content_block_stop`), `message_delta` with the stop reason and usage, `message_stop`.

The chat completion's formatter turns each backend event into chunk deltas (reasoning,
content, tool-call fragments, as the chat route streams them); `BlockStream` turns those
into content blocks, opening a block when the kind of delta changes. A failure after the
stream started is an `error` event, as Anthropic sends it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from backends.base import Usage
from backends.events import close_events
from gateway.anthropic.errors import error_body
from gateway.anthropic.translate import Ending, stop_fields, usage_body
from gateway.chunk_stream import StreamEnd, formatted_chunks
from gateway.generation import Choices, Generation, as_openai_error
from gateway.openai.responses import ChatFormatter

JSON = dict[str, Any]


def frame(data: JSON) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


@dataclass
class BlockStream:
    """The content blocks of one streamed message, built from chat chunk deltas."""

    message_id: str
    model: str
    stops: list[str] | None
    index: int = -1  # the block being written
    kind: str | None = None  # its type: "thinking", "text", "tool_use"
    calls: dict[int, int] = field(default_factory=dict)  # tool call index -> its block
    finish_reason: str = "stop"

    def start(self, input_tokens: int) -> list[JSON]:
        message = {"id": self.message_id, "type": "message", "role": "assistant",
                   "model": self.model, "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": usage_body(Usage(input_tokens, 0))}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _open(self, block: JSON) -> list[JSON]:
        events = self._close()
        self.index += 1
        self.kind = block["type"]
        events.append({"type": "content_block_start", "index": self.index,
                       "content_block": block})
        return events

    def _close(self) -> list[JSON]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _delta(self, kind: str, empty: JSON, delta: JSON) -> list[JSON]:
        events = self._open(empty) if self.kind != kind else []
        events.append({"type": "content_block_delta", "index": self.index, "delta": delta})
        return events

    def chunk(self, chunk: JSON) -> list[JSON]:
        """The events of one chat completion chunk (one choice)."""
        choice = chunk["choices"][0]
        delta, events = choice["delta"], []
        if delta.get("reasoning_content"):
            thinking = {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
            events += self._delta("thinking", {"type": "thinking", "thinking": "",
                                               "signature": ""}, thinking)
        if delta.get("content"):
            events += self._delta("text", {"type": "text", "text": ""},
                                  {"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        return events

    def _call(self, call: JSON) -> list[JSON]:
        events: list[JSON] = []
        if "id" in call:  # a call's first fragment names it
            events = self._open({"type": "tool_use", "id": call["id"],
                                 "name": call["function"]["name"], "input": {}})
            self.calls[call["index"]] = self.index
        arguments = call.get("function", {}).get("arguments")
        if arguments and self.calls.get(call["index"]) == self.index:
            events.append({"type": "content_block_delta", "index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": arguments}})
        return events

    def finish(self, usage: Usage, ending: Ending) -> list[JSON]:
        stop_reason, stop_sequence = stop_fields(
            Ending(self.finish_reason, ending.stop_reason, ending.stop_sequence), self.stops)
        return [*self._close(),
                {"type": "message_delta",
                 "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                 "usage": usage_body(usage)},
                {"type": "message_stop"}]


def ending_of(got: Choices) -> Ending:
    """How the (one) choice ended: its finish reason and the backend's stop."""
    last = got.last()
    if last is None:
        return Ending("stop")
    return Ending(last.finish_reason or "stop", last.stop_reason, last.stop_sequence)


async def message_stream(gen: Generation, chat: ChatFormatter, blocks: BlockStream,
                         input_tokens: int) -> AsyncIterator[bytes]:
    """The SSE frames of one generation (one choice), always closing the backend's iterator."""
    try:
        for event in blocks.start(input_tokens):
            yield frame(event)
        async with aclosing(formatted_chunks(gen, chat)) as chunks:
            async for item in chunks:
                if isinstance(item, StreamEnd):
                    for out in blocks.finish(item.usage, ending_of(item.got)):
                        yield frame(out)
                else:
                    for out in blocks.chunk(item):
                        yield frame(out)
    except Exception as exc:
        err = as_openai_error(exc)
        gen.trace.failed(err.failure_kind())  # the first reason given stays
        yield frame(error_body(err))
    finally:
        await close_events(gen.events)
