"""What the HTTP backends share: the client's life, health, limits, counts, in-flight gauge.

Health: `check_health()` asks the upstream (a GET of `health_path`); routing's background
checker calls it every `health_check_interval`. `health()` answers the last check without
asking anything, so `/health` polls never reach the upstream.

Bounds: a request without `max_tokens` is sent with the room its prompt leaves in the window
(`max_total_tokens` less the prompt as counted here), which is what the gateway reserved
against the key's budget: an upstream with a larger window, or one that takes "no limit" as
the rest of its own window, cannot generate past the reservation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import aiohttp

from backends.base import (
    BackendStats,
    BackendUnavailable,
    DeploymentError,
    GenerationEvent,
    GenerationRequest,
    Health,
    ModelInfo,
    StepTiming,
)
from backends.remote.client import UpstreamClient
from backends.remote.options import DEFAULT_MAX_TOTAL_TOKENS, UpstreamOptions, api_key
from backends.remote.timeouts import TimeoutJudge
from backends.remote.tokenizer import TokenCounter, load_tokenizer

log = logging.getLogger(__name__)


class UpstreamBackend:
    """A Backend whose model runs elsewhere. Subclasses say how to ask and how to read."""

    kind = "upstream"
    health_path = "/health"

    def __init__(self, name: str, options: UpstreamOptions) -> None:
        self.name = name
        self.options = options
        self.upstream_model = options.model or name
        key = api_key(options, name)
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.counter = TokenCounter(load_tokenizer(options.tokenizer) if options.tokenizer
                                    else None)
        self.max_total_tokens = options.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS
        self.max_input_tokens = self.max_total_tokens - 1
        self._client: UpstreamClient | None = None
        self._in_flight = 0
        self._health = Health(False, "not started")
        self._limits_known = options.max_total_tokens is not None
        self._timeouts = TimeoutJudge(options.request_timeout, options.read_timeout,
                                      self._answers_small_generation)

    async def start(self) -> None:
        self._client = UpstreamClient(self.options, self._headers)
        await self._discover()
        await self.check_health()

    async def _discover(self) -> None:
        """The upstream's window, where it says it; tried again at each health check until
        it answers (an upstream down at startup is read once it is up)."""
        if self._limits_known or self._client is None:
            return
        try:
            await self.discover_limits(self._client)
        except (aiohttp.ClientError, TimeoutError, DeploymentError, ValueError, KeyError,
                TypeError) as exc:
            log.warning("%s: could not read the upstream's limits (%s); using %d tokens",
                        self.name, type(exc).__name__, self.max_total_tokens)
            return
        self._limits_known = True

    async def discover_limits(self, client: UpstreamClient) -> None:
        """Read max_total_tokens / max_input_tokens from the upstream, where it says them."""

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    @property
    def client(self) -> UpstreamClient:
        if self._client is None:
            raise BackendUnavailable(f"the {self.kind} backend of {self.name!r} is not started")
        return self._client

    async def health(self) -> Health:
        """The last check's answer (no request to the upstream)."""
        return self._health if self._client is not None else Health(False, "not started")

    async def check_health(self) -> Health:
        """Ask the upstream now, and remember its answer for `health()`."""
        if self._client is None:
            return Health(False, "not started")
        try:
            status = await self._client.status(self.health_path)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._health = Health(False, f"upstream unreachable: {type(exc).__name__}")
            return self._health
        self._health = (Health(False, f"upstream answered {status}") if status >= 400
                        else Health(True, "ready"))
        if self._health.ready:
            await self._discover()
        return self._health

    def info(self) -> ModelInfo:
        return ModelInfo(
            name=self.name, max_input_tokens=self.max_input_tokens,
            max_total_tokens=self.max_total_tokens, backend=self.kind,
            chat_template=self.chat_template(), extra=self.info_extra(),
        )

    def chat_template(self) -> str | None:
        """The template this backend renders chats with; None where the upstream templates."""
        return None

    def info_extra(self) -> dict[str, Any]:
        # Never the base_url: /info is open, and an address is not the client's business.
        return {"upstream_model": self.upstream_model,
                "tokenizer": self.options.tokenizer is not None,
                "usage_source": self.counter.source}

    def stats(self) -> BackendStats:
        return BackendStats(running=self._in_flight)

    def drain_step_timings(self) -> list[StepTiming]:
        return []

    async def bounded(self, req: GenerationRequest) -> GenerationRequest:
        """`req` with `max_tokens` set to the room its prompt leaves, when it has none."""
        if req.sampling.max_tokens is not None:
            return req
        prompt = await asyncio.to_thread(self.count_tokens, req)
        room = max(self.max_total_tokens - prompt, 1)
        return replace(req, sampling=replace(req.sampling, max_tokens=room))

    def count_tokens(self, req: GenerationRequest) -> int:
        return self.counter.prompt_tokens(req)

    def tokenize(self, req: GenerationRequest) -> list[int]:
        return self.counter.prompt_ids(req)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.counter.detokenize(token_ids)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self._in_flight += 1
        started, sent = time.monotonic(), False
        try:
            async with aclosing(self.events(req)) as events:
                try:
                    async for event in events:
                        sent = True
                        yield event
                except DeploymentError as exc:  # a timeout may be the request's own
                    raise await self._timeouts.judge(exc, started, sent=sent) from None
        finally:
            self._in_flight -= 1

    def events(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        raise NotImplementedError

    def small_generation(self) -> tuple[str, dict[str, Any]]:
        """The path and body of a one-token generation, to tell a stuck upstream from a
        request too large for it (backends/remote/timeouts.py)."""
        raise NotImplementedError

    async def _answers_small_generation(self, timeout: float) -> bool:
        path, body = self.small_generation()
        return await self.client.answers(path, body, timeout)
