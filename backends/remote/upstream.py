"""What the HTTP backends share: the client's life, health, limits, counts, in-flight gauge."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import aiohttp

from backends.base import (
    BackendStats,
    BackendUnavailable,
    GenerationEvent,
    GenerationRequest,
    Health,
    ModelInfo,
    StepTiming,
)
from backends.remote.client import UpstreamClient
from backends.remote.options import DEFAULT_MAX_TOTAL_TOKENS, UpstreamOptions, api_key
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

    async def start(self) -> None:
        self._client = UpstreamClient(self.options, self._headers)
        if self.options.max_total_tokens is None:
            try:
                await self.discover_limits(self._client)
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
                log.warning("%s: could not read the upstream's limits (%s); using %d tokens",
                            self.name, exc, self.max_total_tokens)

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
        if self._client is None:
            return Health(False, "not started")
        try:
            status = await self._client.status(self.health_path)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return Health(False, f"upstream unreachable: {type(exc).__name__}")
        if status >= 400:
            return Health(False, f"upstream answered {status}")
        return Health(True, "ready")

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
        return {
            "base_url": self.options.base_url, "upstream_model": self.upstream_model,
            "tokenizer": self.options.tokenizer, "usage_source": self.counter.source,
        }

    def stats(self) -> BackendStats:
        return BackendStats(running=self._in_flight)

    def drain_step_timings(self) -> list[StepTiming]:
        return []

    def count_tokens(self, req: GenerationRequest) -> int:
        return self.counter.prompt_tokens(req)

    def tokenize(self, req: GenerationRequest) -> list[int]:
        return self.counter.prompt_ids(req)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.counter.detokenize(token_ids)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self._in_flight += 1
        try:
            async with aclosing(self.events(req)) as events:
                async for event in events:
                    yield event
        finally:
            self._in_flight -= 1

    def events(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        raise NotImplementedError
