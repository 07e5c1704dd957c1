"""TGI's `/generate_stream` events -> GenerationEvents.

An event is `{"index", "token": {"id", "text", "logprob", "special"}, "generated_text",
"details"}`; the last one has `generated_text` and (with `details: true`) `details =
{"finish_reason", "generated_tokens", "seed", "input_length"?}`. TGI keeps a stop sequence in
its text; the contract (and OpenAI) does not, so text passes through a StopChecker, which
also holds back a partial stop until it is known not to be one. Special tokens keep their
text on the token but add none to the answer, as TGI's `generated_text` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backends.base import FinishReason, GenerationEvent, TokenInfo, Usage
from backends.native.stop_checker import StopChecker  # pure Python, no torch
from backends.remote.http import malformed, stream_error

_FINISH: dict[str, tuple[FinishReason, str | None]] = {
    "length": ("length", None), "eos_token": ("stop", "eos_token"),
    "stop_sequence": ("stop", "stop_sequence"),
}


def _token(frame: dict[str, Any], logprobs: bool) -> TokenInfo:
    token = frame.get("token")
    if not isinstance(token, dict) or not isinstance(token.get("id"), int) \
            or not isinstance(token.get("text"), str):
        raise malformed(f"an event has no valid token: {str(frame)[:200]}")
    logprob = token.get("logprob")
    value = float(logprob) if logprobs and isinstance(logprob, int | float) else None
    return TokenInfo(id=token["id"], text=token["text"], logprob=value,
                     special=bool(token.get("special")))


@dataclass
class FrameReader:
    """Feeds frames; `finished` once the last event was made."""

    logprobs: bool
    stops: StopChecker
    prompt_tokens: Callable[[], int]  # used when TGI's details lack input_length
    generated: int = 0
    finished: bool = False
    details: dict[str, Any] = field(default_factory=dict)

    def feed(self, frame: dict[str, Any]) -> GenerationEvent | None:
        if "error" in frame:
            raise stream_error(frame)
        token = _token(frame, self.logprobs)
        self.generated += 1
        text, stopped = self.stops.feed("" if token.special else token.text)
        last = frame.get("generated_text") is not None or frame.get("details") is not None
        if not (stopped or last):
            return GenerationEvent(text=text, tokens=(token,))
        details = frame.get("details")
        if details is not None and not isinstance(details, dict):
            raise malformed(f"details is not an object: {details!r}")
        self.details = details or {}
        if not stopped:
            text += self.stops.flush()
        self.finished = True
        return self._last(text, token, stopped)

    def _last(self, text: str, token: TokenInfo, stopped: bool) -> GenerationEvent:
        reason, stop_reason = ("stop", "stop_sequence") if stopped else _FINISH.get(
            str(self.details.get("finish_reason")), ("stop", "eos_token"))
        prompt = self.details.get("input_length")
        generated = self.details.get("generated_tokens")
        usage = Usage(
            prompt if isinstance(prompt, int) else self.prompt_tokens(),
            generated if isinstance(generated, int) and not stopped else self.generated,
        )
        seed = self.details.get("seed")
        return GenerationEvent(
            text=text, tokens=(token,), finish_reason=reason, usage=usage,
            stop_reason=stop_reason, seed=seed if isinstance(seed, int) else None,
        )
