"""LLMEngine: add_request / abort / step. Synchronous; runs in the engine thread.

A request with `n` choices is one sequence until its prompt is computed; in the step that
samples its first token it forks into n sequences sharing the prompt's KV blocks (the block
manager copies a shared block on write), each sampling from its own generator.

An embedding model's engine (`task="embed"`) runs prompts only: `add_embedding` queues one
sequence per input, and each step pools instead of sampling (native/embedding.py).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from backends.base import SamplingParams, StepTiming
from backends.native.config import EngineConfig
from backends.native.embedding import Pooler
from backends.native.loading.model_setup import LoadedModel, load_model
from backends.native.outputs import ChoiceOutputs, RequestOutput, held_text, request_output
from backends.native.runner.greedy_head import plain_greedy
from backends.native.runner.model_runner import ModelRunner
from backends.native.runner.step_result import GreedyTokens, StepLogits, StepResult
from backends.native.sampling.grammar_support import GrammarSupport
from backends.native.sampling.sampler import SamplerOutput, sample
from backends.native.scheduling.block_manager import BlockManager
from backends.native.scheduling.deadlines import QUEUE_TIMEOUT, expired
from backends.native.scheduling.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from backends.native.scheduling.sequence import Sequence, SequenceStatus
from backends.native.scheduling.step_faults import raise_injected_fault, settle, suspects

if TYPE_CHECKING:
    from backends.native.structured import CompiledGrammar

log = logging.getLogger(__name__)
# The warm-up's last prefill: past Int4Linear's row threshold (128), under typical budgets.
WARMUP_PREFILL_ROWS = 160


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
        self.pooler = Pooler(self.loaded.pooling) if self.loaded.pooling is not None else None
        # An embedding model has no lm_head and never decodes: no regions ending in logits.
        regions = config.compile and self.pooler is None
        self.runner = ModelRunner(
            self.loaded.model, self.loaded.kv_cache, self.loaded.device,
            self.loaded.sliding_window, compiled=config.compile,
            whole_step=regions and config.compile_decode_step,
            compiled_prefill=regions and _compiles_prefill(config, self.loaded),
            greedy_head=self.pooler is None and config.greedy_head,
        )
        self.generator = torch.Generator().manual_seed(config.seed)
        self._groups: dict[str, list[Sequence]] = {}  # request id -> its unfinished choices
        self.choice_outputs = ChoiceOutputs(self.tokenizer)
        self.grammars = GrammarSupport(self.tokenizer, self.logits_width)
        self.step_timings: deque[StepTiming] = deque(maxlen=10_000)
        self.num_aborted = 0
        self.faults: set[str] = set(config.fault_request_ids)  # tests: step_faults.py
        timeouts = (config.queue_timeout, config.request_timeout)
        self._deadlines = timeouts if any(t is not None for t in timeouts) else None
        self.started: list[str] = []  # see take_started
        self.num_queue_timeouts = self.num_request_timeouts = 0
        self.num_step_failures = self.num_failed_requests = 0

    @property
    def max_total_tokens(self) -> int:
        return self.loaded.max_total_tokens

    @property
    def logits_width(self) -> int:
        """Columns of the logits (the lm_head's rows; may exceed the tokenizer's vocabulary)."""
        return int(self.loaded.hf_config.vocab_size)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
        grammar: CompiledGrammar | None = None, arrival_time: float | None = None,
    ) -> Sequence:
        """Choice 0 runs the prompt; choices 1..n-1 fork off it once the prompt is computed.
        `grammar`: the compiled structured-output constraint (each choice gets a matcher).
        `arrival_time` (time.monotonic()): when the request arrived; default now."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already running")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        room = self.max_total_tokens - len(prompt_token_ids)
        max_tokens = min(sampling.max_tokens or room, room)
        eos = frozenset() if sampling.ignore_eos else self.tokenizer.eos_token_ids
        now = time.monotonic() if arrival_time is None else arrival_time
        choices = [
            self._choice(request_id, i, list(prompt_token_ids), sampling, max_tokens,
                         eos | frozenset(sampling.stop_token_ids), now, grammar)
            for i in range(max(1, sampling.n))
        ]
        first = choices[0]
        first.unforked = choices[1:]
        first.choices = list(choices)
        self._groups[request_id] = choices
        self.scheduler.add(first)
        return first

    def add_embedding(
        self, request_id: str, prompts: list[list[int]], arrival_time: float | None = None,
    ) -> list[Sequence]:
        """Queue an embedding request: one prompt-only sequence per input, pooled into a
        vector by the step that completes it (an embedding model's engine only)."""
        assert self.pooler is not None, "this engine's model is not an embedding model"
        if request_id in self._groups or not prompts or not all(prompts):
            raise ValueError(f"request {request_id!r} is already running or has no input")
        now = time.monotonic() if arrival_time is None else arrival_time
        seqs = [self.pooler.sequence(request_id, i, p, now) for i, p in enumerate(prompts)]
        self._groups[request_id] = list(seqs)
        for seq in seqs:
            self.scheduler.add(seq)
        return seqs

    def _choice(
        self, request_id: str, index: int, prompt: list[int], sampling: SamplingParams,
        max_tokens: int, eos: frozenset[int], now: float, grammar: CompiledGrammar | None,
    ) -> Sequence:
        seq_id = request_id if index == 0 else f"{request_id}#{index}"
        seq = Sequence(seq_id, prompt, sampling, max_tokens, eos_token_ids=eos,
                       arrival_time=now, group_id=request_id, index=index)
        if index:
            seq.status = SequenceStatus.NEW
        self.choice_outputs.start(seq)
        if grammar is not None:
            seq.grammar = self.grammars.matcher(grammar, prompt)
        if not sampling.is_greedy:  # TGI reports the seed a sampled request used
            seed = sampling.seed + index if sampling.seed is not None else random.getrandbits(63)
            seq.seed, seq.generator = seed, torch.Generator().manual_seed(seed)
        return seq

    def abort(self, request_id: str) -> None:
        """Abort every choice of the request."""
        choices = self._groups.pop(request_id, [])
        for seq in choices:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self.num_aborted += bool(choices)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        outputs = self._expire() if self._deadlines else []
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return outputs
        start = time.perf_counter()
        self._mark_started(batch.seqs)
        if self.pooler is not None:
            return outputs + self._pool_step(self.pooler, batch, start)
        sampling_seqs, spans = batch.sampling_seqs(), batch.prompt_spans()
        # Taken before anything can fail: a failed step frees the copies' destination blocks,
        # and copies left queued would write into blocks another request may own by then.
        copies = self.block_manager.take_copies()
        masks = None
        try:
            masks = self.grammars.submit_masks(sampling_seqs)  # overlaps the forward pass
            self.runner.copy_blocks(copies)
            greedy = masks is None and not spans and plain_greedy(sampling_seqs)
            result = self.runner.run(batch, greedy)
            if self.faults:
                raise_injected_fault(self.faults, batch)
            bitmask = masks.result() if masks is not None else None
            self.scheduler.postprocess(batch)
            if isinstance(result, StepLogits):
                prompt_rows = result.logits[len(sampling_seqs):]
                self.choice_outputs.record_prompt_logprobs(prompt_rows, spans)
            rows, seqs = self._fork(sampling_seqs)
            chosen = self._choose(result, rows, seqs, bitmask)
            for seq, token, logprob, top in zip(
                seqs, chosen.token_ids, chosen.logprobs, chosen.top_logprobs, strict=True
            ):
                outputs.append(self._append(seq, token, logprob, top))
        except Exception as exc:
            settle(masks)
            # Outputs already made stay: a choice that finished must still report it.
            return outputs + self._step_failed(batch, exc)
        self._record_step(batch, time.perf_counter() - start)
        return outputs

    def _pool_step(self, pooler: Pooler, batch: ScheduledBatch,
                   start: float) -> list[RequestOutput]:
        """An embedding model's step: pool the batch's rows; each sequence whose prompt is
        now complete finishes (its blocks freed at once) with its vector as its output."""
        try:
            pooled = self.runner.pool(batch, pooler.mode)
            if self.faults:
                raise_injected_fault(self.faults, batch)
            self.scheduler.postprocess(batch)
        except Exception as exc:
            return self._step_failed(batch, exc)
        pooler.add(pooled)
        outputs = []
        for seq in [s for s in batch.seqs if s.num_computed_tokens == s.num_tokens]:
            vector = pooler.vector(seq)
            self._finish(seq, "stop")
            outputs.append(request_output(seq, "", [], embedding=vector))
        self._record_step(batch, time.perf_counter() - start)
        return outputs

    def _mark_started(self, seqs: list[Sequence]) -> None:
        now = time.monotonic()
        for seq in seqs:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
                # Before this step runs, the computed tokens are the prefix cache's hits.
                seq.cached_tokens = seq.num_computed_tokens
                self.started.append(seq.group_id)

    def take_started(self) -> list[str]:
        """Request ids scheduled for the first time since the last call (no longer queued)."""
        started, self.started = self.started, []
        return started

    def _step_failed(self, batch: ScheduledBatch, exc: Exception) -> list[RequestOutput]:
        """A step that ran one sequence fails its request; a larger one is undone and each of
        its requests retried alone (step_faults.py)."""
        self.num_step_failures += 1
        if len(batch.seqs) == 1:
            log.error("engine step failed for request %s alone; failing it",
                      batch.seqs[0].group_id, exc_info=exc)
            return self._fail(batch.seqs)
        log.warning("engine step of %d sequences failed (%r); retrying each alone",
                    len(batch.seqs), exc)
        self.scheduler.rollback(suspects(batch, self._groups))
        return []

    def _expire(self) -> list[RequestOutput]:
        """End the requests past --queue-timeout / --request-timeout ("abort", the reason in
        stop_reason)."""
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for request_id, reason in expired(self._groups, now, *self._deadlines):
            if reason == QUEUE_TIMEOUT:
                self.num_queue_timeouts += 1
            else:
                self.num_request_timeouts += 1
            for choice in list(self._groups.get(request_id, [])):
                self._finish(choice, "abort", reason)
                outputs.append(request_output(choice, "", []))
        return outputs

    def _fork(self, seqs: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """Fork the choices of sequences whose prompt just completed: each child shares the
        parent's blocks and samples its first token from the parent's logits row."""
        rows: list[int] = []
        out: list[Sequence] = []
        for row, seq in enumerate(seqs):
            rows.append(row)
            out.append(seq)
            for child in seq.unforked:
                self.scheduler.fork(seq, child)
                child.first_scheduled = seq.first_scheduled
                child.cached_tokens = seq.cached_tokens
                rows.append(row)
                out.append(child)
            seq.unforked = []
        return rows, out

    def _choose(
        self, result: StepResult, rows: list[int], seqs: list[Sequence],
        bitmask: torch.Tensor | None,
    ) -> SamplerOutput:
        """The token of each of `seqs` from its row of the step (`rows`, from _fork)."""
        if isinstance(result, GreedyTokens):
            return SamplerOutput([result.token_ids[row] for row in rows], [None] * len(rows),
                                 [[] for _ in rows])
        if not seqs:
            return SamplerOutput([], [], [])
        logits = result.logits
        if rows != list(range(len(rows))):  # forked choices repeat their parent's row
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            bitmask = None if bitmask is None else bitmask[rows]
        return sample(logits[: len(rows)], seqs, self.generator, bitmask)

    def _record_step(self, batch: ScheduledBatch, seconds: float) -> None:
        prefill = False
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            prefill |= n > 1 or seq.num_computed_tokens <= seq.num_prompt_tokens
        method = "prefill" if prefill else "decode"
        self.step_timings.append(StepTiming(method, seconds, len(batch.seqs)))

    def fail_all(self) -> list[RequestOutput]:
        """Finish every unfinished choice with "error" (after an unexpected failure outside
        a step's own guard); returns their final outputs."""
        return self._fail([choices[0] for choices in list(self._groups.values()) if choices])

    def _fail(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Fail every choice of the sequences' requests (forks may share the suspect blocks)."""
        outputs = []
        self.num_failed_requests += len({seq.group_id for seq in seqs if not seq.is_finished})
        for seq in seqs:
            for choice in list(self._groups.get(seq.group_id, [seq])):
                if not choice.is_finished:  # half-written K/V: uncache the blocks
                    self._finish(choice, "error", forget_blocks=True)
                    outputs.append(request_output(choice, "", []))
        return outputs

    def _append(
        self, seq: Sequence, token: int, logprob: float | None, top: list[tuple[int, float]],
    ) -> RequestOutput:
        seq.append_token(token, logprob)
        info, text, stopped = self.choice_outputs.token(seq, token, logprob, top)
        grammar_ok, grammar_done = self._advance_grammar(seq, token)
        if stopped:
            self._finish(seq, "stop", "stop_sequence")
        elif token in seq.eos_token_ids:
            self._finish(seq, "stop", "eos_token")
        elif not grammar_ok:
            log.error("request %s: the grammar rejected sampled token %d", seq.group_id, token)
            self._finish(seq, "error")
        elif grammar_done:  # only EOS could follow: as good as one
            self._finish(seq, "stop", "eos_token")
        elif seq.num_output_tokens >= seq.max_tokens:
            self._finish(seq, "length")
        if seq.is_finished and not stopped:
            text += held_text(seq)
        output = request_output(seq, text, [info])
        wants_prompt = seq.sampling.prompt_logprobs is not None and seq.index == 0
        if wants_prompt and seq.num_output_tokens == 1:
            output.prompt_token_infos = self.choice_outputs.take_prompt_infos(seq)
        return output

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> tuple[bool, bool]:
        """(token accepted, grammar complete); (True, False) without a grammar."""
        matcher = seq.grammar
        if matcher is None:
            return True, False
        return matcher.accept(token), matcher.is_terminated

    def _finish(
        self, seq: Sequence, reason: str, stop_reason: str | None = None,
        forget_blocks: bool = False,
    ) -> None:
        self.scheduler.finish(seq, reason, forget_blocks=forget_blocks)
        seq.finished_at = time.monotonic()
        seq.stop_reason = stop_reason
        group = self._groups.get(seq.group_id)
        if group is not None and seq in group:
            group.remove(seq)
            if not group:
                del self._groups[seq.group_id]

    def warmup(self) -> None:
        """Compile at load what the first clients would otherwise pay for (TGI warms up at
        startup too): a mixed step (the per-layer decode attention beside a prefill), then
        decode-only steps of three rows and of one (the two whole-step graphs), then, with the
        compiled prefill step on quantized weights, a prefill past int4 linears' row threshold
        (their graphs differ there)."""
        def greedy(n: int) -> SamplingParams:
            return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

        tag = f"warmup-{time.monotonic_ns()}"
        if self.pooler is not None:  # prompts only: a one-row step (decode attention), a longer
            self.add_embedding(tag, [[1], [1, 2, 3]])
        else:
            self.add_request(f"{tag}-0", [1, 2, 3], greedy(4))  # decodes alone in its last step
            self.step()
            self.add_request(f"{tag}-1", [1, 2, 4], greedy(2))
            self.add_request(f"{tag}-2", [1, 2, 5, 6], greedy(2))
        self.run_until_idle()
        if self.runner.prefill_step is not None and self.loaded.quantization is not None:
            rows = min(WARMUP_PREFILL_ROWS, self.loaded.max_input_tokens)
            self.add_request(f"{tag}-3", [1 + i % 7 for i in range(rows)], greedy(1))
            self.run_until_idle()
        self.step_timings.clear()

    def run_until_idle(self) -> None:
        while self.has_work():
            self.step()

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
    ) -> list[Sequence]:
        """Offline helper (tests, benchmarks): run prompts to completion, return the sequences."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        base = len(self._groups)
        seqs = [
            self.add_request(f"offline-{base}-{i}-{time.monotonic_ns()}", p, s)
            for i, (p, s) in enumerate(zip(prompts, params, strict=True))
        ]
        self.run_until_idle()
        return seqs


def _compiles_prefill(config: EngineConfig, loaded: LoadedModel) -> bool:
    if config.compile_prefill_step is not None:
        return config.compile_prefill_step
    return loaded.quantization is None

