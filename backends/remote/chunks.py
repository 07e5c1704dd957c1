"""OpenAI stream chunks (chat or text completion) -> GenerationEvents.

Text deltas become events at once; the finish reason and the usage chunk that follows it
are held for the last event. A token's id is unknown to OpenAI's API (-1), except in vLLM's
`token_id:N` spelling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backends.base import (
    DeploymentError,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    TokenInfo,
    Usage,
)
from backends.remote.http import malformed, stream_error
from backends.remote.tokenizer import TokenCounter

UNKNOWN_TOKEN_ID = -1
_FINISH: dict[str, FinishReason] = {"length": "length", "abort": "abort", "error": "error"}


def _token(text: str, logprob: Any) -> TokenInfo:
    token_id = UNKNOWN_TOKEN_ID
    if text.startswith("token_id:") and text[9:].isdigit():
        token_id = int(text[9:])
    value = float(logprob) if isinstance(logprob, int | float) else None
    return TokenInfo(id=token_id, text=text, logprob=value)


def _chat_tokens(logprobs: Any) -> tuple[TokenInfo, ...]:
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return ()
    return tuple(_token(str(t.get("token", "")), t.get("logprob"))
                 for t in content if isinstance(t, dict))


def _completion_tokens(logprobs: Any) -> tuple[TokenInfo, ...]:
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("tokens"), list):
        return ()
    values = logprobs.get("token_logprobs") or [None] * len(logprobs["tokens"])
    return tuple(_token(str(t), lp) for t, lp in zip(logprobs["tokens"], values, strict=False))


def _usage(data: Any) -> Usage:
    if not isinstance(data, dict):
        raise malformed(f"usage is not an object: {data!r}")
    prompt, completion = data.get("prompt_tokens"), data.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        raise malformed(f"usage lacks integer token counts: {data!r}")
    return Usage(prompt, completion)


@dataclass
class ChunkReader:
    chat: bool
    text: list[str] = field(default_factory=list)
    finish: str | None = None
    stop_reason: Any = None
    stop_reason_sent: bool = False  # vLLM's extension; OpenAI's API does not say which stop
    usage: Usage | None = None

    def feed(self, chunk: dict[str, Any]) -> GenerationEvent | None:
        """One chunk (or a whole non-streamed answer); an event when it carries text."""
        if "error" in chunk:
            raise stream_error(chunk)
        if chunk.get("usage") is not None:
            self.usage = _usage(chunk["usage"])
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise malformed(f"a chunk has no choices: {str(chunk)[:200]}")
        if not choices:
            return None
        choice = choices[0]
        if not isinstance(choice, dict):
            raise malformed(f"a choice is not an object: {choice!r}")
        text, tokens = self._content(choice)
        if choice.get("finish_reason"):
            self.finish = str(choice["finish_reason"])
            self.stop_reason = choice.get("stop_reason")
            self.stop_reason_sent = "stop_reason" in choice
        if not text and not tokens:
            return None
        self.text.append(text)
        return GenerationEvent(text=text, tokens=tokens)

    def _content(self, choice: dict[str, Any]) -> tuple[str, tuple[TokenInfo, ...]]:
        if self.chat:
            delta = choice.get("delta") or choice.get("message") or {}
            text = delta.get("content") if isinstance(delta, dict) else None
            tokens = _chat_tokens(choice.get("logprobs"))
        else:
            text = choice.get("text")
            tokens = _completion_tokens(choice.get("logprobs"))
        if text is not None and not isinstance(text, str):
            raise malformed(f"content is not a string: {text!r}")
        return text or "", tokens

    def last(self, counter: TokenCounter, req: GenerationRequest) -> GenerationEvent:
        """The finishing event: finish reason and usage (counted here if the upstream did not)."""
        if self.finish is None:
            raise DeploymentError("the upstream ended the stream without a finish reason",
                                  status_code=502, code="upstream_error")
        usage = self.usage or Usage(counter.prompt_tokens(req),
                                    counter.completion_tokens("".join(self.text)))
        reason = _FINISH.get(self.finish, "stop")
        return GenerationEvent(finish_reason=reason, usage=usage,
                               stop_reason=self._stop_reason(reason, req))

    def _stop_reason(self, reason: str, req: GenerationRequest) -> str | None:
        """eos_token / stop_sequence where the upstream said (or no stop was asked), else None."""
        if reason != "stop":
            return None
        if isinstance(self.stop_reason, str):
            return "stop_sequence"
        if self.stop_reason_sent or not req.sampling.stop:
            return "eos_token"
        return None
