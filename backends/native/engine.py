"""LLMEngine: add_request / abort / step. Synchronous; runs in the engine thread."""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass

import torch

from backends.base import RequestTimings, SamplingParams, StepTiming, TokenInfo
from backends.native.block_manager import BlockManager
from backends.native.config import EngineConfig
from backends.native.detokenizer import IncrementalDetokenizer
from backends.native.model_runner import ModelRunner
from backends.native.model_setup import LoadedModel, load_model
from backends.native.sampler import sample
from backends.native.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from backends.native.sequence import Sequence
from backends.native.stop_checker import StopChecker

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    text: str
    tokens: list[TokenInfo]
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: RequestTimings | None = None
    seed: int | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config)
        self.tokenizer = self.loaded.tokenizer
        self.block_manager = BlockManager(
            self.loaded.num_blocks, config.block_size, prefix_caching=config.prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_batch_size, config.max_batch_prefill_tokens, config.chunked_prefill,
                config.waiting_served_ratio, config.max_waiting_tokens,
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(
            self.loaded.model, self.loaded.kv_cache, self.loaded.device,
            self.loaded.sliding_window, compiled=config.compile,
        )
        self.generator = torch.Generator().manual_seed(config.seed)
        self._seqs: dict[str, Sequence] = {}
        self.step_timings: deque[StepTiming] = deque(maxlen=10_000)
        self.num_aborted = 0

    @property
    def max_total_tokens(self) -> int:
        return self.loaded.max_total_tokens

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
    ) -> Sequence:
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        room = self.max_total_tokens - len(prompt_token_ids)
        max_tokens = min(sampling.max_tokens or room, room)
        eos = frozenset() if sampling.ignore_eos else self.tokenizer.eos_token_ids
        seq = Sequence(
            request_id, list(prompt_token_ids), sampling, max_tokens,
            eos_token_ids=eos | frozenset(sampling.stop_token_ids), arrival_time=time.monotonic(),
        )
        seq.extras["detokenizer"] = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        seq.extras["stops"] = StopChecker(sampling.stop)
        if sampling.temperature > 0:  # TGI reports the seed a sampled request used
            seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
            seq.extras["seed"] = seed
            seq.extras["generator"] = torch.Generator().manual_seed(seed)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            self.num_aborted += 1

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        start = time.perf_counter()
        try:
            logits, sampling_seqs = self.runner.run(batch)
            sampled = sample(logits, sampling_seqs, self.generator) if sampling_seqs else None
        except Exception:
            log.exception("engine step failed; failing its %d requests", len(batch.seqs))
            return self._fail(batch)
        self.scheduler.postprocess(batch)
        self._record_step(batch, time.perf_counter() - start)
        if sampled is None:
            return []
        return [
            self._append(seq, token, logprob)
            for seq, token, logprob in zip(
                sampling_seqs, sampled.token_ids, sampled.logprobs, strict=True
            )
        ]

    def _record_step(self, batch: ScheduledBatch, seconds: float) -> None:
        now = time.monotonic()
        prefill = False
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.extras.setdefault("first_scheduled", now - seconds)
            prefill |= n > 1 or seq.num_computed_tokens <= seq.num_prompt_tokens
        method = "prefill" if prefill else "decode"
        self.step_timings.append(StepTiming(method, seconds, len(batch.seqs)))

    def _fail(self, batch: ScheduledBatch) -> list[RequestOutput]:
        outputs = []
        for seq in batch.seqs:  # their blocks may hold half-written K/V: uncache them
            self._finish(seq, "error", forget_blocks=True)
            outputs.append(self._output(seq, "", []))
        return outputs

    def _append(self, seq: Sequence, token: int, logprob: float) -> RequestOutput:
        seq.append_token(token, logprob)
        piece = seq.extras["detokenizer"].add(token)
        text, stopped = seq.extras["stops"].feed(piece)
        info = TokenInfo(
            token, piece, logprob if seq.sampling.logprobs else None,
            self.tokenizer.is_special(token),
        )
        if stopped:
            self._finish(seq, "stop", "stop_sequence")
        elif token in seq.eos_token_ids:
            self._finish(seq, "stop", "eos_token")
        elif seq.num_output_tokens >= seq.max_tokens:
            self._finish(seq, "length")
        if seq.is_finished and not stopped:
            text += seq.extras["stops"].flush()
        return self._output(seq, text, [info])

    def _finish(
        self, seq: Sequence, reason: str, stop_reason: str | None = None,
        forget_blocks: bool = False,
    ) -> None:
        self.scheduler.finish(seq, reason, forget_blocks=forget_blocks)
        seq.extras["finished"] = time.monotonic()
        seq.stop_reason = stop_reason
        self._seqs.pop(seq.request_id, None)

    def _output(self, seq: Sequence, text: str, tokens: list[TokenInfo]) -> RequestOutput:
        output = RequestOutput(
            seq.request_id, text, tokens, seq.is_finished, seq.finish_reason, seq.stop_reason,
            seq.num_prompt_tokens, seq.num_output_tokens,
        )
        if seq.is_finished:
            output.timings = _timings(seq)
            output.seed = seq.extras.get("seed")
        return output

    def warmup(self) -> None:
        """Run two tiny requests so that the first client does not pay for compiling the
        decode kernel (TGI warms up at startup too)."""
        greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        self.generate([[1, 2, 3], [1, 2, 4]], greedy)
        self.step_timings.clear()

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
    ) -> list[Sequence]:
        """Offline helper (tests, benchmarks): run prompts to completion, return the sequences."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        base = len(self._seqs)
        seqs = [
            self.add_request(f"offline-{base}-{i}-{time.monotonic_ns()}", p, s)
            for i, (p, s) in enumerate(zip(prompts, params, strict=True))
        ]
        while self.has_work():
            self.step()
        return seqs


def _timings(seq: Sequence) -> RequestTimings:
    started = seq.extras.get("first_scheduled", seq.extras["finished"])
    return RequestTimings(
        queue_seconds=max(0.0, started - seq.arrival_time),
        inference_seconds=max(0.0, seq.extras["finished"] - started),
    )
