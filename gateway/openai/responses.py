"""Response bodies and stream chunks in OpenAI's exact shapes.

A formatter per endpoint turns backend output into `chat.completion[.chunk]` or
`text_completion` objects; the streaming and non-streaming paths share them. With
`n > 1` every chunk carries one choice, named by its `index`; each choice gets its own
finish chunk. A chat formatter with a tool plan runs a tool-call parser per choice:
calls become `message.tool_calls` (or `delta.tool_calls` fragments) and the finish
reason `tool_calls`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from backends.base import ReasoningSplit, TokenInfo, Usage
from gateway.openai.logprobs import CompletionLogprobs, chat_logprobs

if TYPE_CHECKING:
    from gateway.openai.tools import ToolCallParser, ToolPlan

JSON = dict[str, Any]


def usage_dict(usage: Usage) -> JSON:
    body: JSON = {
        "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return body


class ChoiceOutput(Protocol):
    """One finished choice (gateway.generation.Collected)."""

    index: int
    text: list[str]
    tokens: list[TokenInfo]
    finish_reason: str | None
    reasoning: list[str] | None  # a thinking model's: the text split (None: all content)
    content: list[str] | None


@dataclass
class ResponseMeta:
    """What every chunk of one response shares."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, obj: str) -> JSON:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


class Formatter(Protocol):
    meta: ResponseMeta
    include_usage: bool

    def opening_chunks(self) -> list[JSON]: ...

    def delta_chunks(self, index: int, text: str, tokens: Sequence[TokenInfo],
                     split: ReasoningSplit | None = None) -> list[JSON]:
        """What one event of choice `index` adds (nothing, when a parser holds it back);
        `split`: a thinking model's text as reasoning and content."""
        ...

    def finish_chunks(self, index: int, finish_reason: str) -> list[JSON]: ...

    def usage_chunk(self, usage: Usage) -> JSON: ...

    def body(self, choices: Sequence[ChoiceOutput], usage: Usage) -> JSON: ...


@dataclass(frozen=True)
class ResponseOptions:
    """What the client asked to see: logprobs (with `top` alternatives), choice count, a
    thinking model's reasoning."""

    n: int = 1
    logprobs: bool = False
    top: int = 0
    include_usage: bool = False
    include_reasoning: bool = True


class ChatFormatter:
    def __init__(self, meta: ResponseMeta, options: ResponseOptions, tools: ToolPlan | None = None,
                 ) -> None:
        self.meta = meta
        self.options = options
        self.include_usage = options.include_usage
        self.tools = tools
        self._parsers: dict[int, ToolCallParser | None] = {}

    def _parser(self, index: int) -> ToolCallParser | None:
        if index not in self._parsers:
            self._parsers[index] = self.tools.parser() if self.tools is not None else None
        return self._parsers[index]

    def _chunk(self, index: int, delta: JSON, finish_reason: str | None,
               logprobs: JSON | None) -> JSON:
        chunk = self.meta.head("chat.completion.chunk")
        chunk["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish_reason}]
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs(self, tokens: Sequence[TokenInfo]) -> JSON | None:
        return chat_logprobs(tokens, self.options.top) if self.options.logprobs else None

    def opening_chunks(self) -> list[JSON]:
        return [self._chunk(i, {"role": "assistant", "content": ""}, None, None)
                for i in range(self.options.n)]

    def delta_chunks(self, index: int, text: str, tokens: Sequence[TokenInfo],
                     split: ReasoningSplit | None = None) -> list[JSON]:
        parser = self._parser(index)
        content, calls = text if split is None else split.content, []
        reasoning = split.reasoning if split is not None and self.options.include_reasoning else ""
        if parser is not None:
            parsed = parser.feed(content)
            content, calls = parsed.content, parsed.tool_calls
        logprobs = self._logprobs(tokens) if tokens else None
        if not content and not calls and not reasoning and logprobs is None:
            return []
        delta = _delta(content, calls, reasoning)
        return [self._chunk(index, delta, None, logprobs)]

    def finish_chunks(self, index: int, finish_reason: str) -> list[JSON]:
        chunks = []
        parser = self._parser(index)
        if parser is not None:
            rest = parser.finish()
            if rest.content or rest.tool_calls:
                chunks.append(self._chunk(index, _delta(rest.content, rest.tool_calls),
                                          None, None))
            finish_reason = _with_calls(finish_reason, parser.calls)
        chunks.append(self._chunk(index, {}, finish_reason, None))
        return chunks

    def usage_chunk(self, usage: Usage) -> JSON:
        chunk = self.meta.head("chat.completion.chunk")
        chunk.update(choices=[], usage=usage_dict(usage))
        return chunk

    def _choice(self, choice: ChoiceOutput) -> JSON:
        parts = choice.text if choice.content is None else choice.content
        text, reason = "".join(parts), choice.finish_reason or "stop"
        message: JSON = {"role": "assistant", "content": text}
        parser = self.tools.parser() if self.tools is not None else None
        if parser is not None:
            content = parser.feed(text).content + parser.finish().content
            if parser.calls:
                message = {"role": "assistant", "content": content if content.strip() else None,
                           "tool_calls": parser.calls}
                reason = _with_calls(reason, parser.calls)
            else:
                message["content"] = content
        if choice.reasoning is not None and self.options.include_reasoning:
            message["reasoning_content"] = "".join(choice.reasoning) or None
        return {"index": choice.index, "message": message,
                "logprobs": self._logprobs(choice.tokens), "finish_reason": reason}

    def body(self, choices: Sequence[ChoiceOutput], usage: Usage) -> JSON:
        body = self.meta.head("chat.completion")
        body["choices"] = [self._choice(c) for c in choices]
        body["usage"] = usage_dict(usage)
        return body


def _delta(content: str, calls: list[JSON], reasoning: str = "") -> JSON:
    delta: JSON = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content or not (calls or reasoning):
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta


def _with_calls(finish_reason: str, calls: list[JSON]) -> str:
    # A call cut short by max_tokens is no call: "length" stays.
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


class CompletionFormatter:
    def __init__(self, meta: ResponseMeta, options: ResponseOptions) -> None:
        self.meta = meta
        self.options = options
        self.include_usage = options.include_usage
        self._logprobs: dict[int, CompletionLogprobs] = {}  # per choice: offsets run on

    def _logprobs_of(self, index: int, tokens: Sequence[TokenInfo]) -> JSON | None:
        if not self.options.logprobs:
            return None
        state = self._logprobs.setdefault(index, CompletionLogprobs(self.options.top))
        return state.of(tokens)

    def _chunk(self, index: int, text: str, finish_reason: str | None,
               logprobs: JSON | None) -> JSON:
        chunk = self.meta.head("text_completion")
        chunk["choices"] = [{"index": index, "text": text, "logprobs": logprobs,
                             "finish_reason": finish_reason}]
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def opening_chunks(self) -> list[JSON]:
        return []

    def delta_chunks(self, index: int, text: str, tokens: Sequence[TokenInfo],
                     split: ReasoningSplit | None = None) -> list[JSON]:
        if not text and not (self.options.logprobs and tokens):
            return []
        return [self._chunk(index, text, None, self._logprobs_of(index, tokens))]

    def finish_chunks(self, index: int, finish_reason: str) -> list[JSON]:
        return [self._chunk(index, "", finish_reason, None)]

    def usage_chunk(self, usage: Usage) -> JSON:
        chunk = self.meta.head("text_completion")
        chunk.update(choices=[], usage=usage_dict(usage))
        return chunk

    def body(self, choices: Sequence[ChoiceOutput], usage: Usage) -> JSON:
        body = self.meta.head("text_completion")
        body["choices"] = [{
            "index": c.index, "text": "".join(c.text),
            "logprobs": CompletionLogprobs(self.options.top).of(c.tokens)
            if self.options.logprobs else None,
            "finish_reason": c.finish_reason or "stop",
        } for c in choices]
        body["usage"] = usage_dict(usage)
        return body


def chat_meta(model: str) -> ResponseMeta:
    return ResponseMeta(id=f"chatcmpl-{uuid.uuid4().hex}", model=model)


def completion_meta(model: str) -> ResponseMeta:
    return ResponseMeta(id=f"cmpl-{uuid.uuid4().hex}", model=model)
