"""RemoteBackend: any OpenAI-compatible server (vLLM, SGLang, Ollama, OpenAI, Switchyard).

Always streams upstream and yields each delta as it arrives; with n > 1 each choice's deltas
carry its index, and every choice's finishing event comes once the upstream's stream ended.
Usage comes from the upstream (`stream_options.include_usage`); an upstream that refuses that
option is asked again without it, and from then on usage is counted here
(`info().extra["usage_source"]`).
Closing the event iterator closes the upstream response, so the upstream aborts too.
A request without `max_tokens` is sent with the room its prompt leaves in the window
(`max_total_tokens` less the prompt as counted here): what the gateway reserved against the
key's budget, so an upstream with a larger window cannot generate past the reservation.
An embedding model's requests go to the upstream's /embeddings (backends/remote/embeddings.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from backends.base import GenerationEvent, GenerationRequest, RequestError
from backends.embeddings import EmbeddingRequest, Embeddings
from backends.remote.chunks import ChunkReader
from backends.remote.client import UpstreamClient
from backends.remote.embeddings import embedding_tokens, remote_embeddings
from backends.remote.http import parse_json, sse_data, transport_errors
from backends.remote.options import RemoteOptions
from backends.remote.payload import build_payload
from backends.remote.upstream import UpstreamBackend

log = logging.getLogger(__name__)


def _refuses_stream_options(exc: RequestError) -> bool:
    return exc.status_code in (400, 422) and "stream_options" in exc.message


class RemoteBackend(UpstreamBackend):
    kind = "remote"
    health_path = "/models"

    def __init__(self, name: str, options: RemoteOptions) -> None:
        super().__init__(name, options)
        self._include_usage = True

    async def discover_limits(self, client: UpstreamClient) -> None:
        """vLLM lists `max_model_len` with each model on /models."""
        for card in (await client.get_json("/models")).get("data", []):
            limit = card.get("max_model_len")
            if card.get("id") == self.upstream_model and isinstance(limit, int) and limit > 1:
                self.max_total_tokens, self.max_input_tokens = limit, limit - 1

    def small_generation(self) -> tuple[str, dict[str, Any]]:
        return "/completions", {"model": self.upstream_model, "prompt": ".", "max_tokens": 1}

    def info_extra(self) -> dict[str, Any]:
        extra = super().info_extra()
        extra["usage_source"] = "upstream" if self._include_usage else self.counter.source
        return extra

    async def embed(self, req: EmbeddingRequest) -> Embeddings:
        self._in_flight += 1
        try:
            return await remote_embeddings(self.client, self.upstream_model, self.counter, req)
        finally:
            self._in_flight -= 1

    def count_embedding_tokens(self, req: EmbeddingRequest) -> int:
        return embedding_tokens(self.counter, req)

    async def _open(self, req: GenerationRequest) -> aiohttp.ClientResponse:
        path, body = build_payload(req, self.upstream_model, include_usage=self._include_usage)
        try:
            return await self.client.open_stream(path, body)
        except RequestError as exc:
            if not (self._include_usage and _refuses_stream_options(exc)):
                raise
        log.warning("%s: the upstream refuses stream_options; counting usage with the %s",
                    self.name, self.counter.source)
        self._include_usage = False
        path, body = build_payload(req, self.upstream_model, include_usage=False)
        return await self.client.open_stream(path, body)

    async def events(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        response = await self._open(await self.bounded(req))
        reader = ChunkReader(chat=req.messages is not None, n=req.sampling.n)
        try:
            if response.headers.get("content-type", "").startswith("application/json"):
                whole = await self.client.read_whole(response)
                for event in reader.feed(parse_json(whole.decode("utf-8", "replace"))):
                    yield event
            else:
                with transport_errors(self.options.base_url):
                    done = False
                    # Read to the end, past [DONE]: a response closed unread loses its
                    # keep-alive connection (a new TCP connect per request).
                    async for data in sse_data(response, self.client.limits):
                        done = done or data.strip() == "[DONE]"
                        for event in [] if done else reader.feed(parse_json(data)):
                            yield event
            for event in reader.last(self.counter, req):
                yield event
        finally:
            response.close()  # read to its end, the connection is back in the pool already
