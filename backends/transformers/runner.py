"""Runs one request through transformers' `generate` (synchronously, in the worker thread)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from backends.base import SamplingParams
from backends.transformers.hooks import (
    FrequencyPresencePenalty,
    LogitBias,
    LogprobRecorder,
    SeededSampler,
    TokenBridge,
)
from backends.transformers.loading import LoadedHF
from backends.transformers.tracker import RequestTracker

log = logging.getLogger(__name__)


@dataclass
class Job:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    tracker: RequestTracker
    cancelled: threading.Event = field(default_factory=threading.Event)


def run_job(loaded: LoadedHF, job: Job) -> None:
    """Generate until the tracker finishes the request, it is cancelled, or it fails."""
    job.tracker.start()
    recorder = LogprobRecorder() if job.sampling.logprobs else None
    processors = _processors(job, loaded.device, recorder)
    ids = torch.tensor([job.prompt_ids], dtype=torch.long, device=loaded.device)
    try:
        with torch.inference_mode():
            loaded.model.generate(
                ids, attention_mask=torch.ones_like(ids),
                # Always argmax: a sampled request draws in SeededSampler (see hooks.py).
                generation_config=GenerationConfig(
                    max_new_tokens=job.tracker.max_tokens, do_sample=False
                ),
                logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([TokenBridge(
                    job.tracker, job.cancelled, recorder, job.sampling.top_logprobs)]),
            )
    except Exception:  # a failed request must never stop the worker thread
        log.exception("transformers generate failed for request %s", job.request_id)
        job.tracker.finish("error")
        return
    if not job.cancelled.is_set():
        job.tracker.finish("length")  # a no-op unless generate stopped before the tracker did


def _processors(
    job: Job, device: torch.device, recorder: LogprobRecorder | None,
) -> LogitsProcessorList:
    """Raw logprobs first, then penalties, logit bias, min_tokens' mask, then (sampled)
    temperature, top-k, top-p, min-p, the draw: the native engine's order (transformers' own
    for its sampling processors)."""
    s = job.sampling
    processors: list[LogitsProcessor] = [recorder] if recorder is not None else []
    if s.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
    if s.frequency_penalty or s.presence_penalty:
        processors.append(FrequencyPresencePenalty(
            len(job.prompt_ids), s.frequency_penalty, s.presence_penalty
        ))
    if s.logit_bias:
        processors.append(LogitBias(s.logit_bias, device))
    if s.min_tokens > 0 and job.tracker.stop_ids:
        processors.append(MinNewTokensLengthLogitsProcessor(
            len(job.prompt_ids), s.min_tokens, sorted(job.tracker.stop_ids), device=device))
    if not s.is_greedy:
        if s.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(s.temperature))
        if s.top_k > 0:
            processors.append(TopKLogitsWarper(s.top_k))
        if 0 < s.top_p < 1.0:
            processors.append(TopPLogitsWarper(s.top_p))
        if s.min_p > 0:
            processors.append(MinPLogitsWarper(s.min_p))
        assert job.tracker.seed is not None  # the backend draws one for every sampled request
        generator = torch.Generator(device=device).manual_seed(job.tracker.seed)
        processors.append(SeededSampler(generator))
    return LogitsProcessorList(processors)
