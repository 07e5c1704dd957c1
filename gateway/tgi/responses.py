"""TGI's response shapes: the `/generate` body and the `/generate_stream` events.

`generated_text` is the concatenation of the generated tokens' text, as TGI decodes it:
a stop sequence that ended the request is part of it (TGI keeps it; OpenAI's routes cut
it). Each stream event carries exactly one token; the last one also carries
`generated_text` and, when asked, `details`. TGI sends no `[DONE]`.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from backends.base import TokenInfo, Usage
from gateway.errors import OpenAIError, tgi_error_body
from gateway.generation import (
    Collected,
    Generation,
    as_openai_error,
    close_events,
    final_usage,
    finish_error,
    observe,
    sse,
)

JSON = dict[str, Any]
# A backend whose last event has no token still needs a last event: it gets this one.
_NO_TOKEN = TokenInfo(id=0, text="", logprob=None, special=True)


@dataclass(frozen=True)
class TGIView:
    """How one request wants its answer."""

    inputs: str
    details: bool
    return_full_text: bool
    seed: int | None  # the seed the request sent, when it samples


def token_json(token: TokenInfo) -> JSON:
    lp = token.logprob
    logprob = lp if lp is not None and math.isfinite(lp) else None
    return {"id": token.id, "text": token.text, "logprob": logprob, "special": token.special}


def finish_reason(got: Collected) -> str:
    if got.finish_reason == "length":
        return "length"
    stop_reason = got.last.stop_reason if got.last is not None else None
    return "stop_sequence" if stop_reason == "stop_sequence" else "eos_token"


def generated_text(got: Collected, view: TGIView) -> str:
    text = "".join(t.text for t in got.tokens) if got.tokens else "".join(got.text)
    return view.inputs + text if view.return_full_text else text


def _seed(got: Collected, view: TGIView) -> int | None:
    reported = got.last.seed if got.last is not None else None
    return reported if reported is not None else view.seed


def generate_body(got: Collected, usage: Usage, view: TGIView) -> JSON:
    body: JSON = {"generated_text": generated_text(got, view)}
    if view.details:
        body["details"] = {
            "finish_reason": finish_reason(got), "generated_tokens": usage.completion_tokens,
            "seed": _seed(got, view), "prefill": [],
            "tokens": [token_json(t) for t in got.tokens],
        }
    return body


def generate_headers(usage: Usage, got: Collected, total_s: float) -> dict[str, str]:
    """TGI's timing headers (milliseconds), where the backend reported its timings."""
    headers = {
        "x-prompt-tokens": str(usage.prompt_tokens),
        "x-generated-tokens": str(usage.completion_tokens),
        "x-total-time": str(int(total_s * 1000)),
    }
    timings = got.last.timings if got.last is not None else None
    if timings is not None:
        headers["x-queue-time"] = str(int(timings.queue_seconds * 1000))
        headers["x-inference-time"] = str(int(timings.inference_seconds * 1000))
        per_token = timings.inference_seconds / max(usage.completion_tokens, 1)
        headers["x-time-per-token"] = str(int(per_token * 1000))
    return headers


def _event(index: int, token: TokenInfo) -> JSON:
    return {
        "index": index, "token": token_json(token), "top_tokens": [], "generated_text": None,
        "details": None,
    }


def _last_event(index: int, token: TokenInfo, got: Collected, usage: Usage, view: TGIView) -> JSON:
    event = _event(index, token)
    event["generated_text"] = generated_text(got, view)
    if view.details:
        event["details"] = {
            "finish_reason": finish_reason(got), "generated_tokens": usage.completion_tokens,
            "seed": _seed(got, view), "input_length": usage.prompt_tokens,
        }
    return event


def _split(tokens: Sequence[TokenInfo], last: bool) -> tuple[Sequence[TokenInfo], TokenInfo | None]:
    """An event's tokens to send now, and the one held for the final event."""
    if not last:
        return tokens, None
    return tokens[:-1], (tokens[-1] if tokens else _NO_TOKEN)


async def stream_events(gen: Generation, view: TGIView) -> AsyncIterator[bytes]:
    """SSE frames, one per token; a failure after the start is an `{"error": ...}` event."""
    got, index = Collected(), 0
    try:
        event, final = gen.first, None
        while event is not None:
            last = observe(gen, event, got)
            now, final = _split(event.tokens, last)
            for token in now:
                index += 1
                yield sse(_event(index, token))
            if last:
                break
            event = await anext(gen.events, None)
        error = _stream_error(got)
        if error is not None or final is None:
            err = error or OpenAIError(500, "Incomplete generation", code="incomplete")
            gen.trace.failed("incomplete" if error is None else err.failure_kind())
            yield sse(_tgi_stream_error(err))
            return
        usage = final_usage(gen, got)
        gen.trace.finished(usage, got.last.timings if got.last else None)
        yield sse(_last_event(index + 1, final, got, usage, view))
    except Exception as exc:
        err = as_openai_error(exc)
        gen.trace.failed(err.failure_kind())
        yield sse(_tgi_stream_error(err))
    finally:
        await close_events(gen.events)


def _stream_error(got: Collected) -> OpenAIError | None:
    if got.finish_reason in ("abort", "error"):
        return finish_error(got.finish_reason)
    return None


def _tgi_stream_error(err: OpenAIError) -> JSON:
    body = tgi_error_body(err)
    if err.code == "incomplete":
        body["error_type"] = "incomplete_generation"
    return body
