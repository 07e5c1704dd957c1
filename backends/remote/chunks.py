"""OpenAI stream chunks (chat or text completion) -> GenerationEvents.

Text deltas become events at once, tagged with their choice's `index`; each choice's finish
reason, and the usage chunk that follows them all, are held for the last events (one per
choice). A token's id is unknown to OpenAI's API (-1), except in vLLM's `token_id:N`
spelling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backends.base import (
    DeploymentError,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    ReasoningSplit,
    TokenInfo,
    TopLogprob,
    Usage,
)
from backends.remote.http import malformed, stream_error
from backends.remote.tokenizer import TokenCounter

UNKNOWN_TOKEN_ID = -1
_FINISH: dict[str, FinishReason] = {"length": "length", "abort": "abort", "error": "error"}


def _token_id(text: str) -> int:
    if text.startswith("token_id:") and text[9:].isdigit():
        return int(text[9:])
    return UNKNOWN_TOKEN_ID


def _logprob(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _top(pairs: list[tuple[str, Any]]) -> tuple[TopLogprob, ...]:
    """Alternatives, most likely first (an upstream need not send them in order)."""
    tops = [TopLogprob(_token_id(text), text, lp) for text, value in pairs
            if (lp := _logprob(value)) is not None]
    return tuple(sorted(tops, key=lambda t: -t.logprob))


def _chat_tokens(logprobs: Any) -> tuple[TokenInfo, ...]:
    """Chat's `logprobs.content[]`: {token, logprob, bytes, top_logprobs: [{token, logprob}]}."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return ()
    tokens = []
    for item in content:
        if not isinstance(item, dict):
            continue
        text = str(item.get("token", ""))
        alternatives = item.get("top_logprobs")
        pairs = [(str(a.get("token", "")), a.get("logprob"))
                 for a in alternatives if isinstance(a, dict)] if isinstance(
            alternatives, list) else []
        tokens.append(TokenInfo(_token_id(text), text, _logprob(item.get("logprob")),
                                top_logprobs=_top(pairs)))
    return tuple(tokens)


def _completion_tokens(logprobs: Any) -> tuple[TokenInfo, ...]:
    """Completions' `logprobs`: parallel `tokens`, `token_logprobs`, `top_logprobs` (a
    {token: logprob} object, or null, per position)."""
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("tokens"), list):
        return ()
    texts = [str(t) for t in logprobs["tokens"]]
    values = logprobs.get("token_logprobs") or [None] * len(texts)
    tops = logprobs.get("top_logprobs") or [None] * len(texts)
    return tuple(
        TokenInfo(_token_id(text), text, _logprob(value),
                  top_logprobs=_top(list(top.items())) if isinstance(top, dict) else ())
        for text, value, top in zip(texts, values, tops, strict=False)
    )


def _usage(data: Any) -> Usage:
    if not isinstance(data, dict):
        raise malformed(f"usage is not an object: {data!r}")
    prompt, completion = data.get("prompt_tokens"), data.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        raise malformed(f"usage lacks integer token counts: {data!r}")
    details = data.get("completion_tokens_details")
    reasoning = details.get("reasoning_tokens") if isinstance(details, dict) else None
    # Counts are billed: a negative one from a broken (or hostile) upstream would credit the
    # key's budget. Clamped at 0; reasoning is part of the completion, cached of the prompt.
    prompt, completion = max(prompt, 0), max(completion, 0)
    if isinstance(reasoning, int):
        reasoning = min(max(reasoning, 0), completion)
    return Usage(prompt, completion, reasoning if isinstance(reasoning, int) else None,
                 _cached_tokens(data.get("prompt_tokens_details"), prompt))


def _cached_tokens(details: Any, prompt: int) -> int:
    """OpenAI's `prompt_tokens_details.cached_tokens`, within 0..prompt; 0 when absent."""
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(cached, int) or isinstance(cached, bool):
        return 0
    return min(max(cached, 0), prompt)


def split_total(total: int, weights: list[int]) -> list[int]:
    """`total` in whole parts proportional to `weights` (largest remainders get the rest),
    so the parts always sum to `total`; equal parts when every weight is 0."""
    if sum(weights) == total:
        return list(weights)
    if sum(weights) == 0:
        weights = [1] * len(weights)
    shares = [total * w / sum(weights) for w in weights]
    parts = [int(share) for share in shares]
    by_remainder = sorted(range(len(parts)), key=lambda i: parts[i] - shares[i])
    for i in by_remainder[:total - sum(parts)]:
        parts[i] += 1
    return parts


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    tokens: int = 0  # token entries the upstream's logprobs listed
    finish: str | None = None
    stop_reason: Any = None
    stop_reason_sent: bool = False  # vLLM's extension; OpenAI's API does not say which stop


@dataclass
class ChunkReader:
    chat: bool
    n: int = 1
    choices: dict[int, _Choice] = field(default_factory=dict)
    usage: Usage | None = None

    def feed(self, chunk: dict[str, Any]) -> list[GenerationEvent]:
        """One chunk (or a whole non-streamed answer): an event per choice that has text."""
        if "error" in chunk:
            raise stream_error(chunk)
        if chunk.get("usage") is not None:
            self.usage = _usage(chunk["usage"])
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise malformed(f"a chunk has no choices: {str(chunk)[:200]}")
        events = []
        for choice in choices:
            event = self._feed_choice(choice)
            if event is not None:
                events.append(event)
        return events

    def _feed_choice(self, choice: Any) -> GenerationEvent | None:
        if not isinstance(choice, dict):
            raise malformed(f"a choice is not an object: {choice!r}")
        index = choice.get("index", 0)
        if not isinstance(index, int) or not 0 <= index < self.n:
            raise malformed(f"a choice's index {index!r} is not one of the {self.n} asked for")
        state = self.choices.setdefault(index, _Choice())
        text, tokens = self._content(choice)
        reasoning = self._reasoning(choice)
        if choice.get("finish_reason"):
            state.finish = str(choice["finish_reason"])
            state.stop_reason = choice.get("stop_reason")
            state.stop_reason_sent = "stop_reason" in choice
        if not text and not tokens and not reasoning:
            return None
        state.text.append(text)
        state.tokens += len(tokens)
        split = ReasoningSplit(reasoning, text) if reasoning else None
        return GenerationEvent(text=text, tokens=tokens, index=index, split=split)

    def _reasoning(self, choice: dict[str, Any]) -> str:
        """A thinking model's reasoning: vLLM's `reasoning_content` (DeepSeek's name), or
        `reasoning` (newer vLLM, OpenRouter)."""
        if not self.chat:
            return ""
        delta = choice.get("delta") or choice.get("message") or {}
        if not isinstance(delta, dict):
            return ""
        value = delta.get("reasoning_content") or delta.get("reasoning")
        if value is not None and not isinstance(value, str):
            raise malformed(f"reasoning is not a string: {value!r}")
        return value or ""

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

    def last(self, counter: TokenCounter, req: GenerationRequest) -> list[GenerationEvent]:
        """The finishing events, one per choice: finish reason and usage (counted here if the
        upstream did not say it)."""
        states = [self.choices.get(i) for i in range(self.n)]
        if any(state is None or state.finish is None for state in states):
            missing = sum(state is None for state in states)
            why = (f"answered {self.n - missing} of the {self.n} choices asked for (does it "
                   "support `n`?)" if missing else "ended the stream without a finish reason")
            raise DeploymentError(f"the upstream {why}", status_code=502, code="upstream_error")
        usages = self._usages(counter, req, states)  # type: ignore[arg-type]
        events = []
        for index, (state, usage) in enumerate(zip(states, usages, strict=True)):
            assert state is not None and state.finish is not None
            reason = _FINISH.get(state.finish, "stop")
            matched = state.stop_reason if isinstance(state.stop_reason, str) else None
            events.append(GenerationEvent(finish_reason=reason, usage=usage, index=index,
                                          stop_reason=_stop_reason(state, reason, req),
                                          stop_sequence=matched if reason == "stop" else None))
        return events

    def _usages(
        self, counter: TokenCounter, req: GenerationRequest, states: list[_Choice],
    ) -> list[Usage]:
        """Each choice's usage: the prompt once, its own completion tokens.

        OpenAI's usage covers the whole answer (the prompt once, every choice's completion
        tokens summed). With n > 1 that sum is split over the choices in proportion to each
        one's length: its token entries when the upstream listed logprobs (then exact), else
        its text counted with the tokenizer (or estimated), scaled so the parts still add up to
        the upstream's total.
        """
        counted = [state.tokens if state.tokens else counter.completion_tokens("".join(
            state.text)) for state in states]
        if self.usage is None:
            prompt = counter.prompt_tokens(req)
            return [Usage(prompt, completion) for completion in counted]
        if self.n == 1:
            return [self.usage]
        parts = split_total(self.usage.completion_tokens, counted)
        # The reasoning total is not split: choice 0 carries it (the gateway sums them).
        reasoning = self.usage.reasoning_tokens
        return [Usage(self.usage.prompt_tokens, part,
                      reasoning if i == 0 or reasoning is None else 0, self.usage.cached_tokens)
                for i, part in enumerate(parts)]


def _stop_reason(state: _Choice, reason: str, req: GenerationRequest) -> str | None:
    """eos_token / stop_sequence where the upstream said (or no stop was asked), else None."""
    if reason != "stop":
        return None
    if isinstance(state.stop_reason, str):
        return "stop_sequence"
    if state.stop_reason_sent or not req.sampling.stop:
        return "eos_token"
    return None
