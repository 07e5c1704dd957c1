"""A TGI request's prompt: its token count (and its ids when `truncate` cut them), measured
once, after the key was admitted, and what admission reserves for it."""

from __future__ import annotations

import asyncio

from backends.base import Backend, GenerationRequest, ModelInfo, RequestError
from gateway.guard import reservation
from gateway.tgi.requests import TGIPlan, TGIValidationError


async def _token_ids(backend: Backend, probe: GenerationRequest) -> list[int] | None:
    """The prompt's ids, or None where the backend cannot tokenize (an HTTP upstream without
    a `tokenizer`): then only a count is known, and only inputs within `truncate` pass."""
    tokenize = getattr(backend, "tokenize", None)
    if tokenize is None:
        return None
    try:
        return await asyncio.to_thread(tokenize, probe)
    except RequestError:
        return None


async def _measure(backend: Backend, inputs: str, truncate: int | None,
                   ) -> tuple[int, list[int] | None]:
    """The prompt's token count, and its token ids when they had to be truncated."""
    probe = GenerationRequest(request_id="count", prompt=inputs)
    if truncate is not None:
        ids = await _token_ids(backend, probe)
        if ids is not None and len(ids) > truncate:
            ids = ids[-truncate:]  # TGI keeps the end of the input
            return len(ids), ids
        if ids is not None:
            return len(ids), None
    count = await asyncio.to_thread(backend.count_tokens, probe)
    if truncate is not None and count > truncate:
        raise TGIValidationError(
            f"`truncate` is not supported by this model's backend for inputs longer than "
            f"`truncate` (it cannot tokenize): the input has {count} tokens, `truncate` is "
            f"{truncate}")
    return count, None


class TGIPrompt:
    """The `PromptCount` of a TGI request (gateway/guard.py): measured at most once."""

    def __init__(self, backend: Backend, info: ModelInfo, inputs: str, todo: TGIPlan,
                 cap: int | None) -> None:
        self._backend = backend
        self._info = info
        self._inputs = inputs
        self._todo = todo
        self._cap = cap
        self._measured: tuple[int, list[int] | None] | None = None

    async def measured(self) -> tuple[int, list[int] | None]:
        """(token count, the truncated ids or None)."""
        if self._measured is None:
            self._measured = await _measure(self._backend, self._inputs, self._todo.truncate)
        return self._measured

    async def count(self) -> int:
        return (await self.measured())[0]

    async def reserve(self) -> int:
        sampling = self._todo.sampling
        return reservation(await self.count(), self._info.max_total_tokens, sampling.max_tokens,
                           sampling.n, self._cap)
