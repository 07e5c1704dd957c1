"""Ollama's answers to /api/chat and /api/generate, made from the chat completion's (or, for
a raw prompt, the completion's) chunks and body: a stream of objects, each a fragment of
the message (`message` for chat, `response` for generate, with `thinking` apart), then one
with `done: true`, why it ended and the counts and durations; or that last object alone,
holding the whole answer.

Durations are nanoseconds, measured here: `prompt_eval_duration` until the first token
(queueing included), `eval_duration` from it to the end, `total_duration` from the request's
arrival; `load_duration` is 0, as served models stay loaded. `prompt_eval_count` is the
whole prompt, tokens the prefix cache served included. A streamed tool call is sent whole,
with its arguments as an object, once its choice ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from backends.base import Usage
from gateway.generation import Choices
from gateway.translated_chat import arguments_object

JSON = dict[str, Any]
NS = 1_000_000_000


def created_at() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class Clock:
    """perf_counter seconds: the request's arrival, the generation's start, its first token
    (the backend's first event, pulled when it opens) and its end."""

    arrived: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first: float | None = None
    ended: float | None = None

    def mark(self, stage: str) -> None:
        setattr(self, stage, time.perf_counter())

    def report(self, usage: Usage) -> JSON:
        ended = self.ended or time.perf_counter()
        started = self.started or self.arrived
        first = self.first or started
        return {"total_duration": _ns(ended - self.arrived), "load_duration": 0,
                "prompt_eval_count": usage.prompt_tokens,
                "prompt_eval_duration": _ns(first - started),
                "eval_count": usage.completion_tokens, "eval_duration": _ns(ended - first)}


def _ns(seconds: float) -> int:
    return max(0, round(seconds * NS))


def done_reason(got: Choices) -> str:
    return "length" if got.items[0].finish_reason == "length" else "stop"


def tool_call(call: JSON, index: int) -> JSON:
    """A chat completion's tool call in Ollama's shape (arguments as an object)."""
    function = call["function"]
    return {"id": call["id"], "function": {
        "index": index, "name": function["name"],
        "arguments": arguments_object(function["arguments"])}}


@dataclass(frozen=True)
class Shape:
    """The objects of one route: /api/chat's (`chat`) or /api/generate's."""

    model: str  # as the client named it
    chat: bool

    def object(self, content: str, thinking: str = "", calls: list[JSON] | None = None,
               done: bool = False) -> JSON:
        out: JSON = {"model": self.model, "created_at": created_at()}
        if self.chat:
            message: JSON = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        out["done"] = done
        return out

    def done(self, reason: str, clock: Clock, usage: Usage, content: str = "",
             thinking: str = "", calls: list[JSON] | None = None) -> JSON:
        out = self.object(content, thinking, calls, done=True)
        out["done_reason"] = reason
        out.update(clock.report(usage))
        return out

    def loaded(self) -> JSON:
        """The answer to a request with nothing to generate: the model is there."""
        out = self.object("", done=True)
        out["done_reason"] = "load"
        return out

    def whole(self, body: JSON, got: Choices, usage: Usage, clock: Clock) -> JSON:
        """The chat completion (or completion) `body` as the one final object."""
        choice = body["choices"][0]
        message = choice.get("message")
        if message is None:
            return self.done(done_reason(got), clock, usage, choice["text"])
        calls = [tool_call(c, j) for j, c in enumerate(message.get("tool_calls") or [])]
        return self.done(done_reason(got), clock, usage, message.get("content") or "",
                         message.get("reasoning_content") or "", calls)


@dataclass
class Lines:
    """The streamed objects of one answer, from the formatter's chunks."""

    shape: Shape
    calls: dict[int, JSON] = field(default_factory=dict)  # tool calls being streamed

    def chunk(self, chunk: JSON) -> list[JSON]:
        choice = chunk["choices"][0]
        delta = choice.get("delta")
        if delta is None:  # a completion's chunk
            content, thinking = choice.get("text") or "", ""
        else:
            content, thinking = delta.get("content") or "", delta.get("reasoning_content") or ""
            for fragment in delta.get("tool_calls") or []:
                self._add(fragment)
        out = [self.shape.object(content, thinking)] if content or thinking else []
        if choice.get("finish_reason") is not None and self.calls:
            calls = [tool_call(c, j) for j, c in enumerate(self.calls.values())]
            out.append(self.shape.object("", calls=calls))
            self.calls = {}
        return out

    def _add(self, fragment: JSON) -> None:
        call = self.calls.setdefault(fragment["index"], {
            "id": fragment.get("id", ""), "function": {"name": "", "arguments": ""}})
        function = fragment.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""
