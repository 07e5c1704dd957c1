"""TransformersEmbeddingBackend: encoder embedding models (BERT / XLM-R families) behind the
embeddings contract (backends/embeddings.py), for models declared with `task: embed` on the
transformers backend.

One worker thread owns torch (backends/torch_thread.py) and runs one request at a time, its
inputs in padded batches (encoder.py); requests queue in a thread-safe inbox, and a request
whose client left is skipped. Inputs are tokenized and checked on the event loop's side (off
the loop) before they queue, so a bad input is a 400 that costs the model nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import transformers

from backends.base import BackendStats, BackendUnavailable, Health, ModelInfo, StepTiming
from backends.embeddings import (
    EmbeddingFailed,
    EmbeddingRequest,
    Embeddings,
    check_dimensions,
    input_ids,
    truncated,
)
from backends.text.prompt_checks import overloaded
from backends.torch_thread import start_torch_thread
from backends.transformers.encoder import LoadedEncoder, embed_batches, load_encoder
from backends.transformers.options import TransformersOptions

log = logging.getLogger(__name__)
_STOP = object()
Done = Callable[[np.ndarray | Exception], None]  # the vectors, or why there are none


@dataclass
class _Job:
    prompts: list[list[int]]
    done: Done
    cancelled: threading.Event = field(default_factory=threading.Event)


class TransformersEmbeddingBackend:
    task = "embed"

    def __init__(self, model_id: str, options: TransformersOptions | None = None,
                 served_name: str | None = None) -> None:
        self.model_id = model_id
        self.options = options or TransformersOptions()
        self.served_name = served_name or os.path.basename(model_id.rstrip("/"))
        self.loaded: LoadedEncoder | None = None
        self._inbox: queue.SimpleQueue[_Job | object] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._in_flight = 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            self._thread, self.loaded = await start_torch_thread(
                "transformers-embed", self._load, self._run)
        except Exception as exc:
            self._error = f"loading failed: {exc}"
            raise

    def _load(self) -> LoadedEncoder:
        if self.options.num_threads:
            torch.set_num_threads(self.options.num_threads)
        return load_encoder(self.model_id, self.options)

    async def close(self) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    async def health(self) -> Health:
        if self._error:
            return Health(False, self._error)
        if self.loaded is None or self._thread is None:
            return Health(False, "loading")
        return Health(True, "ready")

    def info(self) -> ModelInfo:
        loaded = self._ready()
        return ModelInfo(
            name=self.served_name, max_input_tokens=loaded.max_input_tokens,
            max_total_tokens=loaded.max_input_tokens, dtype=str(loaded.dtype).removeprefix(
                "torch."), backend="transformers",
            extra={"model_id": loaded.path, "device": loaded.device.type,
                   "dtype_reason": loaded.dtype_reason, "task": self.task,
                   "architecture": type(loaded.model).__name__,
                   "pooling": loaded.pooling.report(), "embedding_size": loaded.size,
                   "transformers_version": transformers.__version__,
                   "max_concurrent_requests": self.options.max_concurrent_requests})

    def stats(self) -> BackendStats:
        return BackendStats(queue_size=self._inbox.qsize(), running=self._in_flight)

    def drain_step_timings(self) -> list[StepTiming]:
        return []

    def _ready(self) -> LoadedEncoder:
        if self.loaded is None or self._thread is None:
            raise BackendUnavailable(self._error or "the model is still loading")
        return self.loaded

    def _input_ids(self, req: EmbeddingRequest) -> list[list[int]]:
        loaded = self._ready()
        return input_ids(req.inputs, loaded.encode, vocab_size=loaded.vocab_size,
                         max_input_tokens=loaded.max_input_tokens,
                         truncate=req.truncate)

    def count_embedding_tokens(self, req: EmbeddingRequest) -> int:
        return sum(len(ids) for ids in self._input_ids(req))

    async def embed(self, req: EmbeddingRequest) -> Embeddings:
        loaded = self._ready()
        check_dimensions(req.dimensions, loaded.size, loaded.pooling.normalize,
                         self.served_name)
        if self._in_flight >= self.options.max_concurrent_requests:
            raise overloaded(self.options.max_concurrent_requests, "max_concurrent_requests")
        self._in_flight += 1
        try:
            prompts = await asyncio.to_thread(self._input_ids, req)
            vectors = await self._run_job(prompts)
        finally:
            self._in_flight -= 1
        return Embeddings(truncated(vectors, req.dimensions), sum(len(p) for p in prompts))

    async def _run_job(self, prompts: list[list[int]]) -> np.ndarray:
        loop = self._loop
        assert loop is not None
        answer: asyncio.Future[np.ndarray | Exception] = loop.create_future()

        def done(result: np.ndarray | Exception) -> None:
            def settle() -> None:
                if not answer.done():
                    answer.set_result(result)
            loop.call_soon_threadsafe(settle)

        job = _Job(prompts, done)
        self._inbox.put(job)
        try:
            result = await answer
        finally:
            job.cancelled.set()  # the worker skips a job whose client left
        if isinstance(result, Exception):
            raise result
        return result

    def _run(self, loaded: LoadedEncoder) -> None:
        while True:
            job = self._inbox.get()
            if not isinstance(job, _Job):  # _STOP: what is still queued will never run
                self._refuse_queued()
                return
            if job.cancelled.is_set():
                continue
            try:
                job.done(embed_batches(loaded, job.prompts))
            except Exception:  # a failed request must never stop the worker thread
                log.exception("transformers embedding failed")
                job.done(EmbeddingFailed(f"the model {self.served_name!r} failed"))

    def _refuse_queued(self) -> None:
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, _Job):
                job.done(BackendUnavailable(f"the model {self.served_name!r} is shutting down"))
