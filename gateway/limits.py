"""Request limits: the body's size (checked while it streams in), the number of messages and
stop strings, a stop string's length, and how many tokens a request may ask to generate.

The body limit is a pure ASGI middleware: a `Content-Length` over the limit is answered 413
before any of the body is read; a chunked body is counted as it arrives and refused as soon
as it passes the limit, so no oversized body is ever held in memory. Whatever the route was
doing with the body then (OpenAI, TGI, admin), the answer is the same 413 in OpenAI's shape.
The rest of the body is left to uvicorn, which discards it, so the client can finish sending
and read the answer.

Field limits are checked on the parsed JSON before the schemas validate it (a 100k-item list
is refused before pydantic walks it): OpenAI's 400 naming the field, or TGI's 422 on its
routes. Values of the wrong type are left for the schemas to refuse.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backends.base import Backend, BackendUnavailable, GenerationRequest, RequestError
from gateway.error_shapes import shaped_response
from gateway.errors import OpenAIError, bad_request
from gateway.settings import RequestLimits
from gateway.tgi.requests import TGIValidationError


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


class BodyTooLarge(OpenAIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413, f"The request body is larger than this server's limit of {_size(limit)} "
                 f"({limit} bytes, set by --max-request-body-bytes or "
                 "SWITCHYARD_MAX_REQUEST_BODY_BYTES).",
            code="request_too_large")


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed length before we see it
    return None


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _answer(send, BodyTooLarge(self.max_bytes), scope["path"])
            return
        await _Counted(self.app, self.max_bytes).run(scope, receive, send)


class _Counted:
    """One exchange whose body is counted; past the limit, its answer becomes the 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.received = 0
        self.exceeded = False
        self.answered = False

    async def run(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                self.received += len(message.get("body", b""))
                if self.received > self.max_bytes:
                    self.exceeded = True
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def replacing_send(message: Message) -> None:
            if not self.exceeded:
                await send(message)
            elif not self.answered:  # the route's own answer to the failed read: ours instead
                self.answered = True
                await _answer(send, BodyTooLarge(self.max_bytes), scope["path"])

        try:
            await self.app(scope, counted_receive, replacing_send)
        except BodyTooLarge:
            if not self.answered:
                self.answered = True
                await _answer(send, BodyTooLarge(self.max_bytes), scope["path"])


async def _answer(send: Send, err: OpenAIError, path: str) -> None:
    response = shaped_response(path, err) or err.response()
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


def _too_long(field: str, limit: int, got: int) -> OpenAIError:
    return bad_request(f"Invalid '{field}': array too long. Expected an array with maximum "
                       f"length {limit}, but got an array with length {got} instead.",
                       field, "array_above_max_length")


def _stops(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    return None


def check_openai_fields(data: Any, limits: RequestLimits) -> None:
    """400 naming the field for too many messages or stop strings, a stop string too long,
    or `max_tokens` / `max_completion_tokens` above --max-output-tokens."""
    if not isinstance(data, dict):
        return
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise _too_long("messages", limits.max_messages, len(messages))
    stops = _stops(data.get("stop"))
    if stops is not None:
        if len(stops) > limits.max_stop_sequences:
            raise _too_long("stop", limits.max_stop_sequences, len(stops))
        for i, stop in enumerate(stops):
            if len(stop) > limits.max_stop_length:
                raise bad_request(
                    f"Invalid 'stop[{i}]': string too long. Expected a string with maximum "
                    f"length {limits.max_stop_length}, but got a string with length "
                    f"{len(stop)} instead.", "stop", "string_above_max_length")
    for field in ("max_tokens", "max_completion_tokens"):
        value = data.get(field)
        cap = limits.max_output_tokens
        if cap is not None and _is_int(value) and value > cap:
            raise bad_request(f"{field} is too large: {value}. This server allows at most {cap} "
                              "generated tokens per request.", field, "invalid_value")


def check_tgi_fields(data: Any, limits: RequestLimits) -> None:
    """TGI's 422 for too many or too long stop strings, or `max_new_tokens` above
    --max-output-tokens (TGI's own bound, the model's --max-total-tokens, comes later)."""
    params = data.get("parameters") if isinstance(data, dict) else None
    if not isinstance(params, dict):
        return
    stops = params.get("stop")
    if isinstance(stops, list) and all(isinstance(s, str) for s in stops):
        if len(stops) > limits.max_stop_sequences:
            raise TGIValidationError(f"`stop` supports up to {limits.max_stop_sequences} stop "
                                     f"sequences. Given: {len(stops)}")
        longest = max((len(s) for s in stops), default=0)
        if longest > limits.max_stop_length:
            raise TGIValidationError(f"`stop` sequences must be at most "
                                     f"{limits.max_stop_length} characters. Given: {longest}")
    value, cap = params.get("max_new_tokens"), limits.max_output_tokens
    if cap is not None and _is_int(value) and value > cap:
        raise TGIValidationError(f"`max_new_tokens` must be <= {cap}. Given: {value}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def output_ceiling(max_tokens: int | None, prompt_tokens: int, max_total_tokens: int,
                   cap: int | None) -> int | None:
    """The tokens a request may generate under --max-output-tokens (`cap`): what it asked,
    at most the cap; when it asked nothing, min(room left in the context, cap). Without a cap,
    or with no room left (the backend then refuses the prompt), what it asked."""
    if cap is None:
        return max_tokens
    if max_tokens is not None:
        return min(max_tokens, cap)
    room = max_total_tokens - prompt_tokens
    return min(room, cap) if room >= 1 else None


async def cap_output(backend: Backend, request: GenerationRequest, cap: int | None,
                     count: Callable[[], Awaitable[int]] | None = None) -> GenerationRequest:
    """An OpenAI request without `max_tokens`, limited to --max-output-tokens (its prompt is
    counted, off the event loop, only then: by `count` when given, the admission's count).
    A prompt that cannot be counted gets the cap: the generation reports what is wrong."""
    if cap is None or request.sampling.max_tokens is not None:
        return request
    try:
        if count is not None:
            prompt = await count()
        else:
            prompt = await asyncio.to_thread(backend.count_tokens, request)
        window = (await asyncio.to_thread(backend.info)).max_total_tokens
        limit = output_ceiling(None, prompt, window, cap)
    except (RequestError, BackendUnavailable):
        limit = cap
    return replace(request, sampling=replace(request.sampling, max_tokens=limit))
