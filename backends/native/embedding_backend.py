"""NativeEmbeddingBackend: an embedding model (task embed) on the native engine.

The same engine thread, inbox, admission and queue limits as generation (NativeBackend); an
embedding request becomes one engine request with a sequence per input (LLMEngine.
add_embedding), and its answer is every input's vector once the last one is pooled. A client
that leaves aborts what is left of it; deadlines answer as they do for generation (503
`queue_timeout`, 504 `request_timeout`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import numpy as np

from backends.base import (
    BackendUnavailable,
    GenerationEvent,
    GenerationRequest,
    ModelInfo,
    RequestError,
)
from backends.embeddings import (
    EmbeddingFailed,
    EmbeddingRequest,
    Embeddings,
    check_dimensions,
    input_ids,
    truncated,
)
from backends.native.backend import NativeBackend, _Abort
from backends.native.config import EngineConfig
from backends.native.llm_engine import LLMEngine, RequestOutput
from backends.native.scheduling.deadlines import QUEUE_TIMEOUT, REQUEST_TIMEOUT
from backends.pooling import Pooling


@dataclass(frozen=True)
class _Embed:
    request_id: str
    prompts: list[list[int]]
    arrival_time: float


class NativeEmbeddingBackend(NativeBackend):
    task = "embed"

    def __init__(self, config: EngineConfig) -> None:
        if config.task != "embed":
            raise ValueError("NativeEmbeddingBackend serves task embed; generation models run "
                             "in NativeBackend")
        super().__init__(config)
        # Each embedding request's finished inputs (None: the engine thread died).
        self._pools: dict[str, asyncio.Queue[RequestOutput | None]] = {}

    def info(self) -> ModelInfo:
        info = super().info()
        pooling = self._pooling()
        return replace(info, extra={**info.extra, "task": self.task, "pooling": pooling.report(),
                                    "embedding_size": self._size()})

    def _pooling(self) -> Pooling:
        pooling = self._ready_engine().loaded.pooling
        assert pooling is not None, "an embed engine loads its pooling"
        return pooling

    def _size(self) -> int:
        return int(self._ready_engine().loaded.hf_config.hidden_size)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        raise RequestError(f"the model `{self.served_name}` is an embedding model (task: embed): "
                           "it serves /v1/embeddings only", param="model",
                           code="model_task_mismatch")
        yield  # unreachable: it makes this an async generator, as the contract wants

    def count_embedding_tokens(self, req: EmbeddingRequest) -> int:
        return sum(len(ids) for ids in self._input_ids(req))

    def _input_ids(self, req: EmbeddingRequest) -> list[list[int]]:
        loaded = self._ready_engine().loaded
        vocab = max(loaded.tokenizer.vocab_size, loaded.hf_config.vocab_size)
        return input_ids(req.inputs, loaded.tokenizer.encode, vocab_size=vocab,
                         max_input_tokens=loaded.max_input_tokens,
                         truncate=req.truncate)

    async def embed(self, req: EmbeddingRequest) -> Embeddings:
        arrival = time.monotonic()
        check_dimensions(req.dimensions, self._size(), self._pooling().normalize,
                         self.served_name)
        self._admit()
        try:
            # Long inputs take milliseconds to tokenize: keep them off the loop.
            prompts = await asyncio.to_thread(self._input_ids, req)
            tokens = sum(len(p) for p in prompts)
            self._waiting.admit(req.request_id, tokens, self._free_slots())
            outputs = await self._pooled(_Embed(req.request_id, prompts, arrival))
        finally:
            self._waiting.leave(req.request_id)
            self._in_flight -= 1
        vectors = np.stack([o.embedding for o in outputs if o.embedding is not None])
        return Embeddings(truncated(vectors, req.dimensions), tokens)

    async def _pooled(self, add: _Embed) -> list[RequestOutput]:
        """Every input's finished output, in input order."""
        pool: asyncio.Queue[RequestOutput | None] = asyncio.Queue()
        self._pools[add.request_id] = pool
        if self._dead:  # no engine thread will ever answer
            self._pools.pop(add.request_id)
            raise BackendUnavailable(self._error or "the engine thread died")
        self._inbox.put(add)
        got: dict[int, RequestOutput] = {}
        try:
            while len(got) < len(add.prompts):
                output = await pool.get()
                if output is None:
                    raise BackendUnavailable(self._error or "the engine thread died")
                if output.embedding is None:
                    raise self._failure(output)
                got[output.index] = output
        finally:
            self._pools.pop(add.request_id, None)
            self._waiting.drain.finished()
            if len(got) < len(add.prompts):  # failed, timed out or the client left
                self._inbox.put(_Abort(add.request_id))
        return [got[i] for i in range(len(add.prompts))]

    def _failure(self, output: RequestOutput) -> Exception:
        if output.stop_reason in (QUEUE_TIMEOUT, REQUEST_TIMEOUT):
            return self._timeout(output.stop_reason)
        return EmbeddingFailed(f"the model failed while embedding input[{output.index}] of "
                               f"request {output.request_id}")

    def _apply(self, engine: LLMEngine, message: object) -> None:
        if not isinstance(message, _Embed):
            super()._apply(engine, message)
            return
        try:
            engine.add_embedding(message.request_id, message.prompts, message.arrival_time)
        except Exception as e:  # a bad request must never stop the engine thread
            self._publish([RequestOutput(message.request_id, "", [], True, "error", str(e),
                                         index=i) for i in range(len(message.prompts))])

    def _publish(self, outputs: list[RequestOutput], started: list[str] | None = None) -> None:
        if (outputs or started) and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver_pooled, list(outputs), started or [])

    def _deliver_pooled(self, outputs: list[RequestOutput], started: list[str]) -> None:
        for request_id in started:
            self._waiting.leave(request_id)
        for output in outputs:
            pool = self._pools.get(output.request_id)
            if pool is not None:
                pool.put_nowait(output)

    def _engine_died(self) -> None:
        super()._engine_died()
        for pool in self._pools.values():
            pool.put_nowait(None)
