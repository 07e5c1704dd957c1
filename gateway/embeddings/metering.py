"""An embedding request against its key and the metrics: admitted before anything is
tokenized, settled with the tokens it read however it ends.

Its inputs' tokens are its prompt: reserved at admission (counted only for keys whose limits
count tokens), charged to the key's tokens per minute and budget, its usage and the access
line, as a generation's prompt is. A client that leaves while its inputs are computed pays
them (they were queued or computed, as a generation's prompt); a request that failed costs
nothing.
"""

from __future__ import annotations

import asyncio
import logging

import anyio
from fastapi import Request

from auth.limits import Consumed
from backends.base import Usage
from backends.embeddings import EmbeddingFailed, EmbeddingRequest, Embeddings
from gateway.errors import OpenAIError
from gateway.generation import as_openai_error
from gateway.guard import Admitted, admit, principal_of
from gateway.metrics import current_request
from gateway.middleware import set_generation_label
from gateway.state import gateway_state
from routing.registry import ModelEntry
from routing.router import ModelRouter

log = logging.getLogger("switchyard.gateway")


class EmbeddingPrompt:
    """The tokens of an embedding request's inputs, counted (off the event loop) at most once."""

    def __init__(self, router: ModelRouter, req: EmbeddingRequest) -> None:
        self._router = router
        self._req = req
        self._count: int | None = None

    async def count(self) -> int:
        if self._count is None:
            self._count = await asyncio.to_thread(self._router.count_embedding_tokens, self._req)
        return self._count

    async def reserve(self) -> int:
        return await self.count()  # nothing is generated


async def embed_admitted(request: Request, entry: ModelEntry,
                         req: EmbeddingRequest) -> Embeddings:
    """`entry`'s vectors for `req`, admitted against the caller's key and settled."""
    prompt = EmbeddingPrompt(entry.router, req)
    admitted = await admit(request, entry.name, prompt)
    set_generation_label(request.scope, req.request_id)
    trace = gateway_state(request).metrics.trace(entry.name)
    try:
        result = await entry.router.embed(req)
    except BaseException as exc:
        left = isinstance(exc, asyncio.CancelledError)
        await _settle(request, admitted, prompt if left else None)
        if isinstance(exc, Exception):
            raise _error(exc) from exc
        raise
    trace.finished(Usage(result.prompt_tokens, 0))
    await _settle(request, admitted, None, Consumed(result.prompt_tokens, 0, True))
    return result


def _error(exc: Exception) -> OpenAIError:
    if isinstance(exc, EmbeddingFailed):
        log.error("embedding failed: %s", exc)
        return OpenAIError(500, "The model failed while computing the embeddings.",
                           error_type="api_error", code="embedding_error")
    return as_openai_error(exc)


async def _settle(request: Request, admitted: Admitted, billed: EmbeddingPrompt | None,
                  consumed: Consumed | None = None) -> None:
    """Settle the reservation with `consumed`, or with `billed`'s tokens (a client that left),
    or with nothing (a failure); and record what was charged."""
    with anyio.CancelScope(shield=True):
        if consumed is None:
            consumed = Consumed(await _counted(billed), 0, True) if billed else Consumed()
        await admitted.admission.settle(consumed)
    if not consumed.counted:
        return
    key_id = principal_of(request).key_id
    if key_id is not None:
        gateway_state(request).metrics.keys.record_usage(key_id, consumed.prompt_tokens, 0)
    labels = current_request.get()
    if labels is not None and labels.prompt_tokens is None:
        labels.prompt_tokens, labels.completion_tokens = consumed.prompt_tokens, 0


async def _counted(prompt: EmbeddingPrompt) -> int:
    try:
        return await prompt.count()
    except Exception:
        log.exception("counting embedding tokens for usage failed")
        return 0
