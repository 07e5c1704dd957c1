"""TGI's `/generate_stream` events -> GenerationEvents.

An event is `{"index", "token": {"id", "text", "logprob", "special"}, "top_tokens",
"generated_text", "details"}`; the last one has `generated_text` and (with `details: true`)
`details = {"finish_reason", "generated_tokens", "seed", "input_length"?}`. TGI keeps a stop
sequence in its text; the contract (and OpenAI) does not, so text passes through a
StopChecker, which also holds back a partial stop until it is known not to be one. Special
tokens keep their text on the token but add none to the answer, as TGI's `generated_text`
does. A whole `/generate` answer (asked for prompt logprobs) is read as the same frames.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backends.base import FinishReason, GenerationEvent, TokenInfo, TopLogprob, Usage
from backends.remote.http import malformed, stream_error
from backends.text.stop_checker import StopChecker  # pure Python, no torch

_FINISH: dict[str, tuple[FinishReason, str | None]] = {
    "length": ("length", None), "eos_token": ("stop", "eos_token"),
    "stop_sequence": ("stop", "stop_sequence"),
}


def _valid(token: Any) -> bool:
    return isinstance(token, dict) and isinstance(token.get("id"), int) \
        and isinstance(token.get("text"), str)


def _logprob(token: dict[str, Any]) -> float | None:
    logprob = token.get("logprob")
    return float(logprob) if isinstance(logprob, int | float) else None


def _top_tokens(value: Any) -> tuple[TopLogprob, ...]:
    """TGI's `top_tokens` (top_n_tokens), most likely first."""
    tops = [TopLogprob(t["id"], t["text"], lp) for t in value or ()
            if _valid(t) and (lp := _logprob(t)) is not None]
    return tuple(sorted(tops, key=lambda t: -t.logprob))


def _token(frame: dict[str, Any], logprobs: bool) -> TokenInfo:
    token = frame.get("token")
    if not _valid(token):
        raise malformed(f"an event has no valid token: {str(frame)[:200]}")
    return TokenInfo(id=token["id"], text=token["text"],
                     logprob=_logprob(token) if logprobs else None,
                     special=bool(token.get("special")),
                     top_logprobs=_top_tokens(frame.get("top_tokens")) if logprobs else ())


def prefill_tokens(details: dict[str, Any]) -> tuple[TokenInfo, ...]:
    """`details.prefill` (decoder_input_details): the prompt's tokens, the first without a
    logprob. TGI lists no alternatives for prompt tokens, so none are given here."""
    prefill = details.get("prefill")
    if not isinstance(prefill, list) or not all(_valid(t) for t in prefill):
        raise malformed(f"details.prefill is not a token list: {str(prefill)[:200]}")
    return tuple(TokenInfo(t["id"], t["text"], None if i == 0 else _logprob(t))
                 for i, t in enumerate(prefill))


def whole_as_frames(answer: Any) -> list[dict[str, Any]]:
    """A whole `/generate` answer as the frames `/generate_stream` would have sent."""
    if isinstance(answer, list) and len(answer) == 1:  # the compat route's shape
        answer = answer[0]
    details = answer.get("details") if isinstance(answer, dict) else None
    tokens = details.get("tokens") if isinstance(details, dict) else None
    if not isinstance(tokens, list) or not tokens:
        raise malformed(f"an answer has no details.tokens: {str(answer)[:200]}")
    tops = details.get("top_tokens") or [[]] * len(tokens)
    frames: list[dict[str, Any]] = [
        {"index": i + 1, "token": token, "top_tokens": top, "generated_text": None,
         "details": None} for i, (token, top) in enumerate(zip(tokens, tops, strict=False))]
    if isinstance(details.get("prefill"), list) and details["prefill"]:
        details = {"input_length": len(details["prefill"]), **details}
    frames[-1].update(generated_text=answer.get("generated_text", ""), details=details)
    return frames


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
        usage = Usage(  # billed: a negative count must not credit a key's budget
            max(prompt, 0) if isinstance(prompt, int) else self.prompt_tokens(),
            max(generated, 0) if isinstance(generated, int) and not stopped else self.generated,
        )
        seed = self.details.get("seed")
        return GenerationEvent(
            text=text, tokens=(token,), finish_reason=reason, usage=usage,
            stop_reason=stop_reason, stop_sequence=self.stops.matched,
            seed=seed if isinstance(seed, int) else None,
        )
