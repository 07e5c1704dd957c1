"""Bounded waiting: the requests admitted but not yet scheduled, and how fast the engine
drains them. Lives on the event loop (no torch, no locks).

A request counts as waiting from admission until the engine first schedules it (or it
ends). The request limit counts only what cannot join the running batch at once (waiting
beyond the batch's free slots); the token limit counts the waiting prompts' tokens (the
prefill backlog, as vLLM's `max_num_queued_tokens`). A refusal is a 429 `overloaded` whose
Retry-After is the backlog divided by the measured drain rate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from backends.base import RequestError

RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 60.0


class DrainRate:
    """Requests finished per second: an exponentially decayed count over `window_s`.

    The count decays as exp(-t / window); a steady rate r fills it to r * window * (1 -
    exp(-age / window)), which `per_second` divides back out (exact for a steady rate, and
    so also right while the first window fills)."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 ) -> None:
        self.window_s = window_s
        self._clock = clock
        self._count = 0.0
        self._at: float | None = None  # when _count was last decayed
        self._since: float | None = None  # the first finish

    def finished(self, n: int = 1) -> None:
        now = self._clock()
        self._decay(now)
        if self._since is None:  # the origin: a rate needs an interval, so it is not counted
            self._since = now
            n -= 1
        self._count += n

    def per_second(self) -> float | None:
        """None until a request finished (0 after the first alone)."""
        if self._since is None:
            return None
        now = self._clock()
        self._decay(now)
        age = max(now - self._since, 1e-3)
        filled = self.window_s * -math.expm1(-age / self.window_s)
        return self._count / filled

    def retry_after(self, backlog: int) -> float:
        """Seconds until `backlog` requests drain at the measured rate, clamped to 1-60 s
        (1 s before any request finished)."""
        rate = self.per_second()
        if not rate:
            return RETRY_AFTER_MIN_S
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, backlog / rate))

    def _decay(self, now: float) -> None:
        if self._at is not None:
            self._count *= math.exp(-(now - self._at) / self.window_s)
        self._at = now


class WaitingRequests:
    """Admitted, not yet scheduled requests: their prompt tokens, the limits, the refusals."""

    def __init__(self, max_requests: int | None, max_tokens: int | None,
                 drain: DrainRate | None = None) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.drain = drain or DrainRate()
        self._tokens: dict[str, int] = {}
        self.total_tokens = 0
        self.rejected_requests = 0
        self.rejected_tokens = 0

    def __len__(self) -> int:
        return len(self._tokens)

    def admit(self, request_id: str, prompt_tokens: int, free_slots: int) -> None:
        """Count the request as waiting, or raise the 429 when a limit would be passed.
        `free_slots`: sequences the running batch can still take."""
        beyond = len(self._tokens) + 1 - max(free_slots, 0)
        if self.max_requests is not None and beyond > self.max_requests:
            self.rejected_requests += 1
            raise self._overloaded(
                beyond, f"{self.max_requests} requests are waiting (--max-queued-requests)")
        tokens = self.total_tokens + prompt_tokens
        if self.max_tokens is not None and self._tokens and tokens > self.max_tokens:
            self.rejected_tokens += 1
            raise self._overloaded(
                max(beyond, 1),
                f"{self.total_tokens} prompt tokens are waiting and this request adds "
                f"{prompt_tokens}, more than {self.max_tokens} (--max-queued-tokens)")
        self._tokens[request_id] = prompt_tokens
        self.total_tokens = tokens

    def leave(self, request_id: str) -> None:
        """Scheduled at last, or ended while waiting (idempotent)."""
        self.total_tokens -= self._tokens.pop(request_id, 0)

    def _overloaded(self, backlog: int, why: str) -> RequestError:
        return RequestError(
            f"the model is overloaded: {why}; retry later",
            code="overloaded", status_code=429, error_type="overloaded",
            retry_after=self.drain.retry_after(backlog),
        )
