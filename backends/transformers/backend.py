"""TransformersBackend: plain Hugging Face `generate` behind the Backend contract.

The reference and the fallback for architectures the native engine lacks. One worker thread
owns torch and runs one `generate` at a time; requests queue in a thread-safe inbox. Each
token reaches its request's asyncio queue through `call_soon_threadsafe` from a
StoppingCriteria (hooks.TokenBridge), which also stops a cancelled request at its next token.
With n > 1 each choice is its own job (seed + index), so the choices' events come one choice
after another. Structured outputs and prompt logprobs are refused (the native engine has them).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import random
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import torch
import transformers

from backends.base import (
    BackendStats,
    BackendUnavailable,
    GenerationEvent,
    GenerationRequest,
    Health,
    ModelInfo,
    RequestError,
    SamplingParams,
    StepTiming,
)
from backends.text.prompt_checks import (
    check_prompt,
    decode_checked,
    encode_request,
    overloaded,
)
from backends.text.token_texts import TokenTexts
from backends.torch_thread import start_torch_thread
from backends.transformers.loading import LoadedHF, load
from backends.transformers.options import TransformersOptions
from backends.transformers.runner import Job, run_job
from backends.transformers.tracker import RequestTracker

log = logging.getLogger(__name__)

_STOP = object()


class TransformersBackend:
    def __init__(
        self, model_id: str, options: TransformersOptions | None = None,
        served_name: str | None = None,
    ) -> None:
        self.model_id = model_id
        self.options = options or TransformersOptions()
        self.served_name = served_name or os.path.basename(model_id.rstrip("/"))
        self.loaded: LoadedHF | None = None
        self.generated_tokens = 0  # cumulative, over all requests (the worker adds to it)
        self._inbox: queue.SimpleQueue[Job | object] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._in_flight = 0
        self._current: Job | None = None
        self._closing = False
        self._texts: TokenTexts | None = None  # alternatives' text pieces, cached

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:  # one thread loads and generates: see torch_thread
            self._thread, self.loaded = await start_torch_thread(
                "transformers", self._load, self._run)
        except Exception as exc:
            self._error = f"loading failed: {exc}"
            raise
        self._texts = TokenTexts(self.loaded.tokenizer)

    def _load(self) -> LoadedHF:
        if self.options.num_threads:
            torch.set_num_threads(self.options.num_threads)
        return load(self.model_id, self.options)

    async def close(self) -> None:
        if self._thread is None:
            return
        self._closing = True
        current = self._current
        if current is not None:
            current.cancelled.set()
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
            name=self.served_name,
            max_input_tokens=loaded.max_input_tokens,
            max_total_tokens=loaded.max_total_tokens,
            dtype=str(loaded.dtype).removeprefix("torch."),
            quantization=loaded.quantization,
            backend="transformers",
            chat_template=loaded.tokenizer.chat_template,
            sampling_defaults=loaded.sampling_defaults,
            extra={
                "model_id": loaded.path,
                "device": loaded.device.type,
                "dtype_reason": loaded.dtype_reason,
                "architecture": type(loaded.model).__name__,
                "transformers_version": transformers.__version__,
                "max_concurrent_requests": self.options.max_concurrent_requests,
                "max_batch_size": 1,
            },
        )

    def stats(self) -> BackendStats:
        current = self._current
        running = 1 if current is not None and not current.tracker.finished else 0
        return BackendStats(queue_size=self._inbox.qsize(), running=running)

    def drain_step_timings(self) -> list[StepTiming]:
        return []  # generate's steps are not observable one by one

    def count_tokens(self, req: GenerationRequest) -> int:
        return len(self.tokenize(req))

    def tokenize(self, req: GenerationRequest) -> list[int]:
        return encode_request(self._ready().tokenizer, req)

    def detokenize(self, token_ids: list[int]) -> str:
        return decode_checked(self._ready().tokenizer, token_ids)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self._admit()
        try:
            # Chat templates and long prompts take milliseconds: keep them off the loop.
            prompt_ids = await asyncio.to_thread(self.tokenize, req)
            field = "messages" if req.messages else "prompt"
            max_tokens = self._validate(prompt_ids, req.sampling, field)
            stream = self._stream(req, prompt_ids, max_tokens)
            async with aclosing(stream) as events:
                async for event in events:
                    yield event
        finally:
            self._in_flight -= 1

    def _admit(self) -> None:
        self._ready()
        self._refuse_if_closing()
        limit = self.options.max_concurrent_requests
        if self._in_flight >= limit:
            raise overloaded(limit, "max_concurrent_requests")
        self._in_flight += 1

    def _validate(self, ids: list[int], sampling: SamplingParams, field: str) -> int:
        """Raise RequestError for a prompt that cannot run; return its max new tokens."""
        loaded = self._ready()
        _refuse_unsupported(sampling)
        check_prompt(ids, sampling, field, vocab_size=loaded.vocab_size,
                     max_input_tokens=loaded.max_input_tokens,
                     max_total_tokens=loaded.max_total_tokens)
        room = loaded.max_total_tokens - len(ids)
        return min(sampling.max_tokens or room, room)

    async def _stream(
        self, req: GenerationRequest, prompt_ids: list[int], max_tokens: int,
    ) -> AsyncIterator[GenerationEvent]:
        """One job per choice (n > 1 runs them one after another, each with its own seed)."""
        loop = self._loop
        assert loop is not None
        events: asyncio.Queue[GenerationEvent] = asyncio.Queue()

        def publish(event: GenerationEvent) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        jobs = [self._job(req, prompt_ids, max_tokens, index, publish)
                for index in range(max(req.sampling.n, 1))]
        self._refuse_if_closing()  # close() may have begun while the prompt was tokenized
        for job in jobs:
            self._inbox.put(job)
        unfinished = len(jobs)
        try:
            while unfinished:
                event = await events.get()
                unfinished -= event.finish_reason is not None
                yield event
        finally:
            if unfinished:
                for job in jobs:  # the worker skips them, or stops one at its next token
                    job.cancelled.set()

    def _job(
        self, req: GenerationRequest, prompt_ids: list[int], max_tokens: int, index: int,
        publish: Callable[[GenerationEvent], None],
    ) -> Job:
        sampling = req.sampling
        seed = None
        if not sampling.is_greedy:  # TGI reports the seed a sampled request used
            seed = sampling.seed + index if sampling.seed is not None else random.getrandbits(63)
        tracker = RequestTracker(self._ready().tokenizer, prompt_ids, sampling, max_tokens, seed,
                                 publish, index=index, texts=self._texts)
        return Job(req.request_id, prompt_ids, sampling, tracker)

    def _ready(self) -> LoadedHF:
        if self.loaded is None or self._thread is None:
            raise BackendUnavailable(self._error or "the model is still loading")
        return self.loaded

    def _run(self, loaded: LoadedHF) -> None:
        while True:
            job = self._inbox.get()
            if not isinstance(job, Job):  # _STOP
                self._abort_queued()
                return
            if job.cancelled.is_set():
                continue
            self._current = job
            try:
                run_job(loaded, job)
                if self._closing:
                    job.tracker.finish("abort")
            finally:
                self.generated_tokens += job.tracker.num_generated
                self._current = None

    def _refuse_if_closing(self) -> None:
        """After close() began, the worker takes no more jobs: a job queued then would wait
        forever."""
        if self._closing:
            raise BackendUnavailable(f"the model {self.served_name!r} is shutting down")

    def _abort_queued(self) -> None:
        """At close: end every request still queued, so that no client waits forever."""
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, Job):
                job.tracker.finish("abort")


def _refuse_unsupported(sampling: SamplingParams) -> None:
    """What `generate` has no hook for here: a 400 naming the parameter and this backend."""
    if sampling.structured is not None:
        raise RequestError(
            f"structured outputs ({sampling.structured.kind}) are not supported by the "
            "transformers backend; use the native engine",
            param=sampling.structured.source, code="unsupported_parameter")
    if sampling.prompt_logprobs is not None:
        raise RequestError(
            "prompt logprobs (`prompt_logprobs`, TGI's `decoder_input_details`) are not "
            "supported by the transformers backend; use the native engine",
            param="prompt_logprobs", code="unsupported_parameter")
