"""The waiting-request bookkeeping and the drain rate behind Retry-After (no engine)."""

from __future__ import annotations

import pytest

from backends.base import RequestError
from backends.native.queue_limits import DrainRate, WaitingRequests


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_drain_rate_measures_a_steady_rate_from_the_first_finish() -> None:
    clock = Clock()
    rate = DrainRate(window_s=10.0, clock=clock)
    assert rate.per_second() is None and rate.retry_after(5) == 1.0
    for _ in range(40):  # 4 requests per second
        clock.now += 0.25
        rate.finished()
        if clock.now > 101:
            assert rate.per_second() == pytest.approx(4.0, rel=0.2)
    assert rate.retry_after(20) == pytest.approx(5.0, rel=0.2)
    assert rate.retry_after(10_000) == 60.0  # clamped
    clock.now += 60  # nothing finished for a minute: the rate decays, the wait grows
    assert rate.per_second() < 0.1
    assert rate.retry_after(2) > 20


def test_request_limit_counts_only_what_cannot_join_the_batch() -> None:
    waiting = WaitingRequests(max_requests=1, max_tokens=None)
    waiting.admit("a", 10, free_slots=2)  # joins at once
    waiting.admit("b", 10, free_slots=2)
    waiting.admit("c", 10, free_slots=2)  # one beyond the batch: allowed
    with pytest.raises(RequestError) as caught:
        waiting.admit("d", 10, free_slots=2)
    err = caught.value
    assert (err.status_code, err.code, err.retry_after) == (429, "overloaded", 1.0)
    assert waiting.rejected_requests == 1 and len(waiting) == 3
    waiting.leave("a")
    waiting.leave("a")  # idempotent
    waiting.admit("d", 10, free_slots=2)
    assert waiting.total_tokens == 30


def test_token_limit_lets_a_lone_request_through() -> None:
    waiting = WaitingRequests(max_requests=None, max_tokens=100)
    waiting.admit("big", 500, free_slots=0)  # alone: it could never run otherwise
    with pytest.raises(RequestError, match="--max-queued-tokens"):
        waiting.admit("small", 1, free_slots=0)
    waiting.leave("big")
    waiting.admit("small", 60, free_slots=0)
    with pytest.raises(RequestError):
        waiting.admit("more", 41, free_slots=0)
    waiting.admit("fits", 40, free_slots=0)
    assert waiting.rejected_tokens == 2 and waiting.total_tokens == 100
