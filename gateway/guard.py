"""The auth guard of the inference routes. Any route gets it by using these pieces:

1. `GUARD` (a FastAPI dependency) on the router or route: the bearer key is checked
   before the body is read (401, or 503 when Redis is away):
   `APIRouter(dependencies=[GUARD])` or `app.include_router(router, dependencies=[GUARD])`.
2. `admit(request, model, prompt)` before the route counts or tokenizes anything: checks the
   key may use the model (403) and admits it against the key's limits (429 + Retry-After;
   prompt + max_tokens reserved, the prompt counted only for keys whose limits count
   tokens, and only once their other limits have room), and adds the x-ratelimit-* headers
   to the response. What the route does before opening the generation runs under
   `Admitted.unless_failing()`, which gives the reservation back when it fails.
3. `open_admitted(request, admitted, backend, gen_request, trace)` in place of
   `open_generation(backend, gen_request, trace)`: settles the reservation with the real
   usage when the generation ends, however it ends (finished, failed, or the client went
   away; one that left before the first token pays its prompt, which was prefilled).

`open_guarded` is 2 and 3 together, for routes with nothing to do in between.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from fastapi import Depends, Request

from auth.access import AccessDenied, Admission, Principal, bearer_token
from auth.limits import Consumed
from auth.policy import RateLimited
from backends.base import (
    Backend,
    BackendUnavailable,
    GenerationEvent,
    GenerationRequest,
    RequestError,
    Usage,
)
from gateway.generation import Generation, as_openai_error, close_events, open_generation
from gateway.key_metrics import KeyMetrics
from gateway.limits import output_ceiling
from gateway.metrics import GenerationTrace, RequestLabels, current_request
from gateway.middleware import set_generation_label, set_key_label
from gateway.response_headers import add_response_headers
from gateway.state import gateway_state

log = logging.getLogger("switchyard.gateway")
PRINCIPAL_KEY = "switchyard.principal"


async def require_key(request: Request) -> Principal:
    """The caller of this request (401 without a valid key; open mode lets everyone in)."""
    return await authenticate(request, bearer_token(request.headers.get("authorization")))


async def authenticate(request: Request, token: str | None) -> Principal:
    """The caller presenting `token` (however the route's API sends it), noted on the request."""
    state = gateway_state(request)
    principal = await state.access.authenticate(token)
    request.scope[PRINCIPAL_KEY] = principal
    set_key_label(request.scope, "admin" if principal.admin else principal.key_id)
    return principal


GUARD = Depends(require_key)


def principal_of(request: Request) -> Principal:
    principal = request.scope.get(PRINCIPAL_KEY)
    if principal is None:
        raise RuntimeError(f"route {request.url.path} is not guarded: add dependencies=[GUARD]")
    return principal


async def require_admin(request: Request) -> Principal:
    principal = await require_key(request)
    if not principal.admin:
        raise AccessDenied("This endpoint needs the admin key (set with --admin-key or "
                           "SWITCHYARD_ADMIN_KEY).", status_code=403, code="admin_key_required")
    return principal


async def metrics_guard(request: Request) -> None:
    """/metrics is open, or needs any valid key, or the admin key (--metrics-auth)."""
    mode = gateway_state(request).settings.metrics_auth
    if mode == "key":
        await require_key(request)
    elif mode == "admin":
        await require_admin(request)


class PromptCount(Protocol):
    """A request's prompt tokens, counted at most once and only when asked, and what
    admission reserves for it."""

    async def count(self) -> int: ...

    async def reserve(self) -> int: ...


def reservation(prompt: int, window: int, max_tokens: int | None, n: int,
                cap: int | None = None) -> int:
    """Prompt + n * the tokens each choice may generate (what it asked, capped by
    --max-output-tokens, at most the room left in the context window)."""
    window = max(window, prompt)
    room = window - prompt
    limit = output_ceiling(max_tokens, prompt, window, cap)
    return prompt + n * (room if limit is None else min(limit, room))


class PromptTokens:
    """A generation request's prompt, counted (off the event loop) at most once."""

    def __init__(self, backend: Backend, request: GenerationRequest,
                 cap: int | None = None) -> None:
        self._backend = backend
        self._request = request
        self._cap = cap
        self._count: int | None = None

    async def count(self) -> int:
        if self._count is None:
            self._count = await asyncio.to_thread(self._backend.count_tokens, self._request)
        return self._count

    async def reserve(self) -> int:
        prompt = await self.count()
        sampling = self._request.sampling
        return reservation(prompt, self._backend.info().max_total_tokens, sampling.max_tokens,
                           sampling.n, self._cap)


class NoPrompt:
    """A request that generates nothing (/tokenize): admitted, reserving no tokens."""

    async def count(self) -> int:
        return 0

    async def reserve(self) -> int:
        return 0


@dataclass
class _Meter:
    """Counts a generation's tokens as they stream, choice by choice, for settlement."""

    admission: Admission
    prompt: PromptCount
    labels: RequestLabels | None = None  # the access line's tokens, when no usage came
    key_metrics: tuple[KeyMetrics, str] | None = None  # per-key series, and the key id
    tokens: dict[int, int] = field(default_factory=dict)  # completion tokens seen, by choice
    finals: dict[int, Usage] = field(default_factory=dict)  # each finished choice's usage
    started: bool = False
    abandoned: bool = False  # cancelled (the client left) before the first event
    settled: bool = False

    def observe(self, event: GenerationEvent) -> None:
        self.started = True
        # A backend that cannot see tokens (an OpenAI-compatible upstream) sends text deltas
        # without them: count each as one, so a stream cut short still bills what it sent.
        seen = len(event.tokens) or (1 if event.text else 0)
        self.tokens[event.index] = self.tokens.get(event.index, 0) + seen
        if event.usage is not None:
            self.finals[event.index] = event.usage

    async def consumed(self) -> Consumed:
        if not self.started:
            # Cancelled while queued or prefilling: the prompt was (being) processed, so it
            # is billed; a generation that failed before its first event costs nothing.
            return Consumed(await self._prompt(), 0, True) if self.abandoned else Consumed()
        completion = sum(
            self.finals[i].completion_tokens if i in self.finals else count
            for i, count in self.tokens.items())
        if self.finals:
            prompt = next(iter(self.finals.values())).prompt_tokens
        else:
            prompt = await self._prompt()
        return Consumed(prompt, completion, True)

    async def _prompt(self) -> int:
        try:
            return await self.prompt.count()
        except Exception:
            log.exception("counting prompt tokens for usage failed")
            return 0

    async def settle(self) -> None:
        if self.settled:
            return
        self.settled = True
        with anyio.CancelScope(shield=True):
            consumed = await self.consumed()
            await self.admission.settle(consumed)
        if self.key_metrics is not None and consumed.counted:
            metrics, key_id = self.key_metrics
            metrics.record_usage(key_id, consumed.prompt_tokens, consumed.completion_tokens)
        if self.labels is not None and self.labels.completion_tokens is None and \
                consumed.counted:
            self.labels.prompt_tokens = consumed.prompt_tokens
            self.labels.completion_tokens = consumed.completion_tokens


async def _metered(events: AsyncIterator[GenerationEvent], meter: _Meter,
                   ) -> AsyncIterator[GenerationEvent]:
    try:
        async for event in events:
            meter.observe(event)
            yield event
    except (asyncio.CancelledError, GeneratorExit):
        meter.abandoned = not meter.started
        raise
    finally:
        await close_events(events)
        await meter.settle()


class _MeteredBackend:
    """The backend, with each generation's events counted for settlement."""

    def __init__(self, backend: Backend, meter: _Meter) -> None:
        self._backend = backend
        self._meter = meter

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        return _metered(self._backend.generate(req), self._meter)

    def count_tokens(self, req: GenerationRequest) -> int:
        return self._backend.count_tokens(req)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


@dataclass
class Admitted:
    """A request admitted against its key, not yet generating."""

    admission: Admission
    prompt: PromptCount

    async def abandon(self) -> None:
        """Give the reservation back: nothing was generated."""
        with anyio.CancelScope(shield=True):
            await self.admission.settle(Consumed())

    @asynccontextmanager
    async def unless_failing(self) -> AsyncIterator[None]:
        """The route's work between admission and generation; a failure gives it back."""
        try:
            yield
        except BaseException:
            await self.abandon()
            raise


async def admit(request: Request, model: str, prompt: PromptCount) -> Admitted:
    """Admit the request against its key before anything is counted or tokenized."""
    state = gateway_state(request)
    try:
        admission = await state.access.admit(principal_of(request), model, prompt.reserve)
    except RateLimited as exc:
        add_response_headers(request.scope, exc.headers)
        key_id = principal_of(request).key_id
        if key_id is not None:
            state.metrics.keys.record_refusal(key_id, exc.limit or exc.code)
        raise
    except (RequestError, BackendUnavailable) as exc:  # from counting the prompt
        raise as_openai_error(exc) from exc
    add_response_headers(request.scope, admission.headers)
    return Admitted(admission, prompt)


async def open_admitted(
    request: Request, admitted: Admitted, backend: Backend, gen_request: GenerationRequest,
    trace: GenerationTrace,
) -> Generation:
    """`open_generation`, settled against the caller's key when it ends."""
    set_generation_label(request.scope, gen_request.request_id)
    key_id = principal_of(request).key_id
    keys = gateway_state(request).metrics.keys
    meter = _Meter(admitted.admission, admitted.prompt, current_request.get(),
                   key_metrics=None if key_id is None else (keys, key_id))
    try:
        return await open_generation(_MeteredBackend(backend, meter), gen_request, trace)
    except BaseException:
        await meter.settle()
        raise


async def open_guarded(
    request: Request, model: str, backend: Backend, gen_request: GenerationRequest,
    trace: GenerationTrace, cap: int | None = None,
) -> Generation:
    """`open_generation`, admitted against the caller's key and settled when it ends."""
    admitted = await admit(request, model, PromptTokens(backend, gen_request, cap))
    return await open_admitted(request, admitted, backend, gen_request, trace)
