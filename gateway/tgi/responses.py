"""TGI's response shapes: the `/generate` body and the `/generate_stream` events.

`generated_text` is the concatenation of the generated tokens' text, as TGI decodes it:
a stop sequence that ended the request is part of it (TGI keeps it; OpenAI's routes cut
it). Each stream event carries exactly one token (and its `top_tokens`); the last one also
carries `generated_text` and, when asked, `details`. TGI sends no `[DONE]`.

`details` (asked by `details` or `decoder_input_details`) lists the tokens, their
`top_tokens` (with `top_n_tokens`), the prompt's tokens as `prefill` (with
`decoder_input_details`; the first has no logprob) and, with `best_of`, the choices that
lost as `best_of_sequences`.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from backends.base import TokenInfo, Usage
from gateway.errors import OpenAIError, tgi_error_body
from gateway.generation import (
    Choices,
    Collected,
    Generation,
    as_openai_error,
    close_events,
    finish_error,
    sse,
)
from gateway.tgi.best_of import best_choice

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
    top_n_tokens: int = 0
    prefill: bool = False  # decoder_input_details


def _logprob(lp: float | None) -> float | None:
    return lp if lp is not None and math.isfinite(lp) else None


def token_json(token: TokenInfo) -> JSON:
    return {"id": token.id, "text": token.text, "logprob": _logprob(token.logprob),
            "special": token.special}


def top_tokens_json(token: TokenInfo) -> list[JSON]:
    """The alternatives at `token`'s position, most likely first. Only the chosen token's
    `special` flag is known here; the contract carries none for the others."""
    return [
        {"id": alt.id, "text": alt.text, "logprob": _logprob(alt.logprob),
         "special": token.special and alt.id == token.id}
        for alt in token.top_logprobs
    ]


def prefill_json(prompt_tokens: Sequence[TokenInfo] | None) -> list[JSON]:
    return [{"id": t.id, "text": t.text, "logprob": _logprob(t.logprob)}
            for t in prompt_tokens or ()]


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


def _sequence(got: Collected, usage: Usage, view: TGIView, prefill: list[JSON]) -> JSON:
    """One choice's details (TGI's `BestOfSequence` fields, which `Details` shares)."""
    body: JSON = {
        "generated_text": generated_text(got, view), "finish_reason": finish_reason(got),
        "generated_tokens": usage.completion_tokens, "seed": _seed(got, view),
        "prefill": prefill, "tokens": [token_json(t) for t in got.tokens],
    }
    if view.top_n_tokens:
        body["top_tokens"] = [top_tokens_json(t) for t in got.tokens]
    return body


def choice_usage(got: Collected, total: Usage) -> Usage:
    return Usage(total.prompt_tokens, got.completion_tokens())


def generate_body(answer: Choices, total: Usage, view: TGIView) -> JSON:
    """The answer (the best choice); its details and the other choices' when asked."""
    choices = answer.items
    best = best_choice(choices)
    body: JSON = {"generated_text": generated_text(choices[best], view)}
    if not view.details:
        return body
    prefill = prefill_json(answer.prompt_tokens) if view.prefill else []
    details = _sequence(choices[best], choice_usage(choices[best], total), view, prefill)
    del details["generated_text"]
    if len(choices) > 1:
        details["best_of_sequences"] = [
            _sequence(other, choice_usage(other, total), view, prefill)
            for i, other in enumerate(choices) if i != best
        ]
    body["details"] = details
    return body


def generate_headers(answer: Choices, total: Usage, total_s: float) -> dict[str, str]:
    """TGI's timing headers (milliseconds), where the backend reported its timings; the
    token counts are the answer's (the best choice's), as TGI's."""
    got = answer.items[best_choice(answer.items)]
    usage = choice_usage(got, total)
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
        "index": index, "token": token_json(token), "top_tokens": top_tokens_json(token),
        "generated_text": None, "details": None,
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
    choices, index = Choices(1), 0
    got = choices.items[0]
    try:
        event, final = gen.first, None
        while event is not None:
            last = choices.add(gen, event)
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
        usage = choices.usage(gen)
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
        return finish_error(got.finish_reason, got.last.stop_reason if got.last else None)
    return None


def _tgi_stream_error(err: OpenAIError) -> JSON:
    body = tgi_error_body(err)
    if err.code == "incomplete":
        body["error_type"] = "incomplete_generation"
    return body
