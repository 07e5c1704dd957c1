"""NativeBackend: the asyncio face of the engine. One engine thread per model.

The event loop never calls torch and the engine thread never awaits: they meet
in a thread-safe inbox of plain messages and per-request asyncio queues fed
through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

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
    StructuredOutput,
    Usage,
)
from backends.native.config import EngineConfig
from backends.native.llm_engine import LLMEngine, RequestOutput
from backends.native.loading.load_progress import (
    LoadTracker,
    describe,
    json_logs_everywhere,
    tracking,
)
from backends.native.loading.startup_cache import LoadStages
from backends.native.models.moe import routed_tokens
from backends.native.queue_limits import WaitingRequests
from backends.native.scheduling.deadlines import QUEUE_TIMEOUT, REQUEST_TIMEOUT
from backends.text.prompt_checks import (
    check_prompt,
    decode_checked,
    encode_request,
    overloaded,
    timed_out,
)
from backends.torch_thread import start_torch_thread

if TYPE_CHECKING:
    from backends.native.structured import CompiledGrammar

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    grammar: CompiledGrammar | None = None
    arrival_time: float | None = None  # time.monotonic() when the request arrived


@dataclass(frozen=True)
class _Abort:
    request_id: str


_STOP = object()


class NativeBackend:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine: LLMEngine | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # None in a stream: the engine thread died.
        self._streams: dict[str, asyncio.Queue[GenerationEvent | None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._in_flight = 0
        self._dead = False  # the engine thread died (set on the event loop)
        self._waiting = WaitingRequests(config.max_queued_requests, config.max_queued_tokens)
        self._stages = LoadTracker()  # the load stage now and those done (/health, /info)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:  # one thread loads and steps: see torch_thread
            self._thread, self.engine = await start_torch_thread("engine", self._load, self._run)
        except Exception as exc:
            self._error = f"loading failed: {exc}"
            raise

    def _load(self) -> LLMEngine:
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        json_logs_everywhere()  # torch's own handlers write plain lines
        with tracking(self._stages):  # each LoadStages stage reports to it
            engine = LLMEngine(self.config)
            if self.config.compile:
                log.info("warming up (compiling the decode kernel)")
                with LoadStages().stage("warm-up compile"):  # logs `load: warm-up compile 1.2s`
                    engine.warmup()
        return engine

    async def close(self) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None
        if self.engine is not None:
            self.engine.grammars.close()

    async def health(self) -> Health:
        if self._error:
            return Health(False, self._error)
        load = self._stages.report()
        if self.engine is None or self._thread is None:
            return Health(False, describe(load), load)
        if not self._thread.is_alive():
            return Health(False, "the engine thread is not running", load)
        return Health(True, "ready", load)

    def info(self) -> ModelInfo:
        engine = self._ready_engine()
        loaded = engine.loaded
        return ModelInfo(
            name=self.served_name,
            max_input_tokens=loaded.max_input_tokens,
            max_total_tokens=loaded.max_total_tokens,
            dtype=str(loaded.dtype).removeprefix("torch."),
            quantization=loaded.quantization,
            backend="native",
            chat_template=engine.tokenizer.chat_template,
            sampling_defaults=loaded.sampling_defaults,
            extra={
                "model_id": loaded.model_path,
                "architecture": getattr(loaded.hf_config, "model_type", None),
                "parameter_count": loaded.parameter_count,
                "thinking": engine.tokenizer.reasoning_markers is not None,  # it reasons
                "device": loaded.device.type,
                "dtype_reason": loaded.dtype_reason,
                "cpu_kernels": loaded.cpu_kernels,  # avx512-bf16 / avx512 / avx2 / none (why)
                "gguf_formats": loaded.gguf_formats.report() if loaded.gguf_formats else None,
                "max_batch_total_tokens": loaded.num_blocks * self.config.block_size,
                "max_batch_size": self.config.max_batch_size,
                "max_batch_prefill_tokens": self.config.max_batch_prefill_tokens,
                "block_size": self.config.block_size,
                "weight_bytes": loaded.weight_bytes,
                "expert_bytes": loaded.expert_bytes,
                "greedy_head_bytes": engine.runner.greedy_head_bytes,
                "max_concurrent_requests": self.config.max_concurrent_requests,
                "max_queued_requests": self.config.max_queued_requests,
                "max_queued_tokens": self.config.max_queued_tokens,
                "queue_timeout": self.config.queue_timeout,
                "request_timeout": self.config.request_timeout,
                "waiting_served_ratio": self.config.waiting_served_ratio,
                "max_waiting_tokens": self.config.max_waiting_tokens,
                "chunked_prefill": self.config.chunked_prefill,
                "prefix_caching": self.config.prefix_caching,
                "load": self._stages.report().report(),  # the load stages and their seconds
            },
        )

    @property
    def served_name(self) -> str:
        return self.config.served_model_name or os.path.basename(self.config.model.rstrip("/"))

    def stats(self) -> BackendStats:
        if self.engine is None:
            return BackendStats()
        blocks, scheduler = self.engine.block_manager, self.engine.scheduler
        running = list(scheduler.running)  # a snapshot: the engine thread edits the list
        return BackendStats(
            queue_size=len(scheduler.waiting),
            running=len(running),
            kv_blocks_used=blocks.num_used_blocks,
            kv_blocks_total=blocks.num_blocks,
            batch_max_tokens=sum(s.max_total_tokens for s in running),
            batch_next_size=scheduler.last_joined,
            prefix_cache_queries=blocks.queries,
            prefix_cache_hits=blocks.hits,
            preemptions=scheduler.num_preemptions,
            queue_rejections_requests=self._waiting.rejected_requests,
            queue_rejections_tokens=self._waiting.rejected_tokens,
            queue_timeouts=self.engine.num_queue_timeouts,
            request_timeouts=self.engine.num_request_timeouts,
            step_failures=self.engine.num_step_failures,
            failed_requests=self.engine.num_failed_requests,
            expert_tokens=routed_tokens(self.engine.loaded.moe_blocks),
        )

    def drain_step_timings(self) -> list[StepTiming]:
        timings: list[StepTiming] = []
        source = self.engine.step_timings if self.engine is not None else None
        while source:
            try:
                timings.append(source.popleft())
            except IndexError:
                break
        return timings

    def count_tokens(self, req: GenerationRequest) -> int:
        return len(self.tokenize(req))

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        arrival = time.monotonic()
        self._admit()
        try:
            # Chat templates and long prompts take milliseconds: keep them off the loop.
            prompt_ids = await asyncio.to_thread(self.tokenize, req)
            self._validate(prompt_ids, req.sampling, "messages" if req.messages else "prompt")
            self._waiting.admit(req.request_id, len(prompt_ids), self._free_slots())
            grammar = await self._compile(req.sampling.structured)
            add = _Add(req.request_id, prompt_ids, req.sampling, grammar, arrival)
            async with aclosing(self._stream(add)) as events:
                async for event in events:
                    yield event
        finally:
            self._waiting.leave(req.request_id)
            self._in_flight -= 1

    def _free_slots(self) -> int:
        """Sequences the running batch can still take (read across threads: a length)."""
        return self.config.max_batch_size - len(self._ready_engine().scheduler.running)

    async def _compile(self, spec: StructuredOutput | None) -> CompiledGrammar | None:
        """The request's grammar, compiled off the event loop (milliseconds to seconds)."""
        if spec is None:
            return None
        from backends.native.structured import GrammarError

        try:
            return await asyncio.to_thread(self._ready_engine().grammars.compile, spec)
        except GrammarError as e:
            raise RequestError(str(e), param=spec.source) from None

    def _admit(self) -> None:
        self._ready_engine()
        if self._in_flight >= self.config.max_concurrent_requests:
            raise overloaded(self.config.max_concurrent_requests, "--max-concurrent-requests")
        self._in_flight += 1

    async def _stream(self, add: _Add) -> AsyncIterator[GenerationEvent]:
        """The events of every choice, until each has finished."""
        stream: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self._streams[add.request_id] = stream
        if self._dead:  # no engine thread will ever answer
            self._streams.pop(add.request_id)
            raise BackendUnavailable(self._error or "the engine thread died")
        self._inbox.put(add)
        unfinished = set(range(max(1, add.sampling.n)))
        first = True
        try:
            while unfinished:
                event = await stream.get()
                if event is None:
                    raise BackendUnavailable(self._error or "the engine thread died")
                if first and event.stop_reason in (QUEUE_TIMEOUT, REQUEST_TIMEOUT):
                    raise self._timeout(event.stop_reason)  # no byte sent yet: a real status
                first = False
                if event.finish_reason is not None:
                    unfinished.discard(event.index)
                yield event
        finally:
            self._streams.pop(add.request_id, None)
            self._waiting.drain.finished()
            if unfinished:
                self._inbox.put(_Abort(add.request_id))

    def _timeout(self, reason: str) -> Exception:
        if reason == QUEUE_TIMEOUT:
            backlog = len(self._waiting) + 1
            return timed_out(reason, self.config.queue_timeout, 503,
                             self._waiting.drain.retry_after(backlog))
        return timed_out(reason, self.config.request_timeout, 504)

    def _ready_engine(self) -> LLMEngine:
        if self.engine is None or self._thread is None:
            raise BackendUnavailable(
                self._error or f"the model is still loading ({describe(self._stages.report())})")
        if not self._thread.is_alive():
            raise BackendUnavailable(self._error or "the engine thread is not running")
        return self.engine

    def tokenize(self, req: GenerationRequest) -> list[int]:
        return encode_request(self._ready_engine().tokenizer, req)

    def detokenize(self, token_ids: list[int]) -> str:
        return decode_checked(self._ready_engine().tokenizer, token_ids)

    def _validate(self, ids: list[int], sampling: SamplingParams, field: str) -> None:
        loaded = self._ready_engine().loaded
        vocab = max(loaded.tokenizer.vocab_size, loaded.hf_config.vocab_size)
        check_prompt(ids, sampling, field, vocab_size=vocab,
                     max_input_tokens=loaded.max_input_tokens,
                     max_total_tokens=loaded.max_total_tokens)

    def _run(self, engine: LLMEngine) -> None:
        try:
            self._serve(engine)
        except BaseException as exc:  # noqa: BLE001 - the thread is dying: say so, and why
            log.critical("the engine thread died; model %s stops serving", self.served_name,
                         exc_info=True)
            self._error = f"the engine thread died: {exc!r}"
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._engine_died)

    def _serve(self, engine: LLMEngine) -> None:
        while True:
            try:
                if not self._drain_inbox(engine, block=not engine.has_work()):
                    return
                if engine.has_work():
                    outputs = engine.step()
                    self._publish(outputs, engine.take_started())
            except Exception:  # the thread must live on, or every request waits forever
                log.exception("engine loop failed; failing every request in flight")
                self._publish(engine.fail_all())

    def _engine_died(self) -> None:
        self._dead = True
        for stream in self._streams.values():
            stream.put_nowait(None)

    def _drain_inbox(self, engine: LLMEngine, block: bool) -> bool:
        """Apply queued adds/aborts; False once asked to stop."""
        while True:
            try:
                message = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if message is _STOP:
                return False
            self._apply(engine, message)

    def _apply(self, engine: LLMEngine, message: object) -> None:
        """One inbox message, in the engine thread."""
        if isinstance(message, _Add):
            self._add(engine, message)
        elif isinstance(message, _Abort):
            engine.abort(message.request_id)

    def _add(self, engine: LLMEngine, message: _Add) -> None:
        try:
            engine.add_request(
                message.request_id, message.prompt_token_ids, message.sampling, message.grammar,
                message.arrival_time,
            )
        except Exception as e:  # a bad request must never stop the engine thread
            log.exception("could not add request %s", message.request_id)
            self._publish([
                RequestOutput(message.request_id, "", [], True, "error", str(e), index=i)
                for i in range(max(1, message.sampling.n))
            ])

    def _publish(self, outputs: list[RequestOutput], started: list[str] | None = None) -> None:
        if (outputs or started) and self._loop is not None:
            events = [(o.request_id, _event(o)) for o in outputs]
            self._loop.call_soon_threadsafe(self._deliver, events, started or [])

    def _deliver(self, events: list[tuple[str, GenerationEvent]], started: list[str]) -> None:
        for request_id in started:
            self._waiting.leave(request_id)
        for request_id, event in events:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(event)


def _event(output: RequestOutput) -> GenerationEvent:
    usage = Usage(output.prompt_tokens, output.completion_tokens,
                  output.reasoning_tokens, output.cached_tokens) if output.finished else None
    return GenerationEvent(
        text=output.text,
        tokens=tuple(output.tokens),
        finish_reason=output.finish_reason if output.finished else None,  # type: ignore[arg-type]
        usage=usage,
        stop_reason=output.stop_reason,
        stop_sequence=output.stop_sequence,
        timings=output.timings,
        seed=output.seed,
        index=output.index,
        prompt_tokens=(
            None if output.prompt_token_infos is None else tuple(output.prompt_token_infos)
        ),
        split=output.split,
    )
