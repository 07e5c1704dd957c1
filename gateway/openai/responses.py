"""Response bodies and stream chunks in OpenAI's exact shapes.

A formatter per endpoint turns backend output into `chat.completion[.chunk]` or
`text_completion` objects; the streaming and non-streaming paths share them.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from backends.base import TokenInfo, Usage

JSON = dict[str, Any]


def usage_dict(usage: Usage) -> JSON:
    return {
        "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


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

    def delta_chunk(self, text: str, tokens: Sequence[TokenInfo]) -> JSON: ...

    def finish_chunk(self, finish_reason: str) -> JSON: ...

    def usage_chunk(self, usage: Usage) -> JSON: ...

    def body(
        self, text: str, tokens: Sequence[TokenInfo], finish_reason: str, usage: Usage,
    ) -> JSON: ...


class ChatFormatter:
    def __init__(self, meta: ResponseMeta, *, logprobs: bool, include_usage: bool) -> None:
        self.meta = meta
        self.logprobs = logprobs
        self.include_usage = include_usage

    def _chunk(self, delta: JSON, finish_reason: str | None, logprobs: JSON | None) -> JSON:
        chunk = self.meta.head("chat.completion.chunk")
        chunk["choices"] = [
            {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ]
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs(self, tokens: Sequence[TokenInfo]) -> JSON | None:
        if not self.logprobs:
            return None
        content = [
            {"token": t.text, "logprob": _logprob(t), "bytes": list(t.text.encode("utf-8")),
             "top_logprobs": []}
            for t in tokens
        ]
        return {"content": content, "refusal": None}

    def opening_chunks(self) -> list[JSON]:
        return [self._chunk({"role": "assistant", "content": ""}, None, None)]

    def delta_chunk(self, text: str, tokens: Sequence[TokenInfo]) -> JSON:
        return self._chunk({"content": text}, None, self._logprobs(tokens))

    def finish_chunk(self, finish_reason: str) -> JSON:
        return self._chunk({}, finish_reason, None)

    def usage_chunk(self, usage: Usage) -> JSON:
        chunk = self.meta.head("chat.completion.chunk")
        chunk.update(choices=[], usage=usage_dict(usage))
        return chunk

    def body(
        self, text: str, tokens: Sequence[TokenInfo], finish_reason: str, usage: Usage,
    ) -> JSON:
        body = self.meta.head("chat.completion")
        message = {"role": "assistant", "content": text}
        body["choices"] = [{
            "index": 0, "message": message, "logprobs": self._logprobs(tokens),
            "finish_reason": finish_reason,
        }]
        body["usage"] = usage_dict(usage)
        return body


class CompletionFormatter:
    def __init__(self, meta: ResponseMeta, *, logprobs: bool, include_usage: bool) -> None:
        self.meta = meta
        self.logprobs = logprobs
        self.include_usage = include_usage
        self._offset = 0  # text_offset of the next token across chunks

    def _chunk(self, text: str, finish_reason: str | None, logprobs: JSON | None) -> JSON:
        chunk = self.meta.head("text_completion")
        chunk["choices"] = [
            {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        ]
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs(self, tokens: Sequence[TokenInfo]) -> JSON | None:
        if not self.logprobs:
            return None
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t.text)
        return {
            "tokens": [t.text for t in tokens], "token_logprobs": [_logprob(t) for t in tokens],
            "top_logprobs": None, "text_offset": offsets,
        }

    def opening_chunks(self) -> list[JSON]:
        return []

    def delta_chunk(self, text: str, tokens: Sequence[TokenInfo]) -> JSON:
        return self._chunk(text, None, self._logprobs(tokens))

    def finish_chunk(self, finish_reason: str) -> JSON:
        return self._chunk("", finish_reason, None)

    def usage_chunk(self, usage: Usage) -> JSON:
        chunk = self.meta.head("text_completion")
        chunk.update(choices=[], usage=usage_dict(usage))
        return chunk

    def body(
        self, text: str, tokens: Sequence[TokenInfo], finish_reason: str, usage: Usage,
    ) -> JSON:
        body = self.meta.head("text_completion")
        body["choices"] = [{
            "index": 0, "text": text, "logprobs": self._logprobs(tokens),
            "finish_reason": finish_reason,
        }]
        body["usage"] = usage_dict(usage)
        return body


def _logprob(token: TokenInfo) -> float:
    # -9999.0 is OpenAI's own stand-in for "too unlikely to represent".
    lp = token.logprob
    return lp if lp is not None and math.isfinite(lp) else -9999.0


def chat_meta(model: str) -> ResponseMeta:
    return ResponseMeta(id=f"chatcmpl-{uuid.uuid4().hex}", model=model)


def completion_meta(model: str) -> ResponseMeta:
    return ResponseMeta(id=f"cmpl-{uuid.uuid4().hex}", model=model)
