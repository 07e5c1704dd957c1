"""The pieces we hand to transformers' `generate`: logits processors and a stopping criterion.

`generate` runs greedy (argmax) always; a sampled request ends its processor list with
`SeededSampler`, which draws with the request's own torch.Generator exactly as transformers'
sampling does (softmax, multinomial) and leaves only the drawn token. So seeds are per request,
with no global RNG, and the draw equals `generate(do_sample=True)` after `torch.manual_seed`.
"""

from __future__ import annotations

import threading

import torch
from transformers import LogitsProcessor, StoppingCriteria

from backends.transformers.tracker import RequestTracker


class LogprobRecorder(LogitsProcessor):
    """First in the list: keeps the raw distribution's log-probabilities of the last step."""

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.last = torch.log_softmax(scores[0].float(), dim=-1)
        return scores

    def logprob(self, token: int) -> float | None:
        return None if self.last is None else float(self.last[token])

    def top(self, k: int) -> list[tuple[int, float]]:
        """The k most likely tokens of the last step, most likely first."""
        if self.last is None or k <= 0:
            return []
        values, indices = self.last.topk(min(k, self.last.shape[-1]))
        return list(zip(indices.tolist(), values.tolist(), strict=True))


class LogitBias(LogitsProcessor):
    """OpenAI's `logit_bias`: a fixed amount added to chosen tokens' logits."""

    def __init__(self, bias: tuple[tuple[int, float], ...], device: torch.device) -> None:
        self._ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=device)
        self._values = torch.tensor([b for _, b in bias], dtype=torch.float32, device=device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores.index_add(1, self._ids, self._values.to(scores.dtype).expand(
            scores.shape[0], -1))


class FrequencyPresencePenalty(LogitsProcessor):
    """OpenAI's penalties over the generated tokens (not the prompt), as the native engine."""

    def __init__(self, prompt_length: int, frequency: float, presence: float) -> None:
        self._prompt_length = prompt_length
        self._frequency = frequency
        self._presence = presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self._prompt_length :]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones_like(generated, dtype=scores.dtype)
        )
        return scores - self._frequency * counts - self._presence * (counts > 0).to(scores.dtype)


class SeededSampler(LogitsProcessor):
    """Last in the list: draws a token from the processed scores with a per-request generator."""

    def __init__(self, generator: torch.Generator) -> None:
        self._generator = generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = torch.softmax(scores, dim=-1)
        chosen = torch.multinomial(probs, num_samples=1, generator=self._generator)
        only = torch.full_like(scores, float("-inf"))
        return only.scatter_(1, chosen, 0.0)


class TokenBridge(StoppingCriteria):
    """Called by `generate` after each new token: feeds the tracker (which streams the token)
    and stops generation once the request is finished or cancelled."""

    def __init__(
        self, tracker: RequestTracker, cancelled: threading.Event,
        recorder: LogprobRecorder | None, top_logprobs: int = 0,
    ) -> None:
        self._tracker = tracker
        self._cancelled = cancelled
        self._recorder = recorder
        self._top_logprobs = top_logprobs

    def __call__(
        self, input_ids: torch.LongTensor, scores: object, **kwargs: object
    ) -> torch.BoolTensor:
        done = self._tracker.finished or self._cancelled.is_set()
        if not done:
            token = int(input_ids[0, -1])
            recorder = self._recorder
            logprob = recorder.logprob(token) if recorder is not None else None
            top = recorder.top(self._top_logprobs) if recorder is not None else []
            done = self._tracker.add(token, logprob, top)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)
