"""The limiters, side by side: the in-memory one and the Redis Lua scripts must agree.

Windows are short here (the memory one runs on a fake clock; Redis on its own TIME).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from auth.limits import Consumed, Limiter, Limits
from auth.memory_limiter import MemoryLimiter
from auth.redis_conn import connect
from auth.redis_limiter import RedisLimiter
from tests.auth.conftest import RedisServer

WINDOW_S = 0.6
LEASE_S = 0.6


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Subject:
    limiter: Limiter
    advance: Callable[[float], Awaitable[None]]
    key: str


@pytest.fixture(params=["memory", "redis"])
async def subject(request: pytest.FixtureRequest, redis_server: RedisServer,
                  ) -> AsyncIterator[Subject]:
    key = "key_" + secrets.token_hex(6)
    if request.param == "memory":
        clock = FakeClock()

        async def tick(seconds: float) -> None:
            clock.now += seconds

        yield Subject(MemoryLimiter(clock, WINDOW_S, LEASE_S), tick, key)
        return
    redis = connect(redis_server.url)
    yield Subject(RedisLimiter(redis, WINDOW_S, LEASE_S), asyncio.sleep, key)
    await redis.aclose()


async def test_requests_per_window_exact_then_sliding(subject: Subject) -> None:
    limits = Limits(rpm=3)
    for expected_used in (1, 2, 3):
        decision, _ = await subject.limiter.acquire(subject.key, limits, 0)
        assert decision.admitted and decision.requests_used == expected_used
    refused, _ = await subject.limiter.acquire(subject.key, limits, 0)
    assert not refused.admitted and refused.reason == "requests"
    assert 0 < refused.retry_after_s <= WINDOW_S
    await subject.advance(WINDOW_S + 0.05)
    again, _ = await subject.limiter.acquire(subject.key, limits, 0)
    assert again.admitted and again.requests_used == 1


async def test_tokens_reserved_then_reconciled(subject: Subject) -> None:
    limits = Limits(tpm=100)
    first, ticket = await subject.limiter.acquire(subject.key, limits, 60)
    assert first.admitted and first.tokens_used == 60
    assert not (await subject.limiter.acquire(subject.key, limits, 50))[0].admitted
    await subject.limiter.release(ticket, "m", Consumed(4, 6, True))  # used 10 of 60
    second, _ = await subject.limiter.acquire(subject.key, limits, 90)
    assert second.admitted and second.tokens_used == 100
    refused, _ = await subject.limiter.acquire(subject.key, limits, 1)
    assert refused.reason == "tokens" and 0 < refused.retry_after_s <= WINDOW_S
    too_large, _ = await subject.limiter.acquire(subject.key, limits, 101)
    assert too_large.reason == "too_large"


async def test_parallel_leases_and_their_expiry(subject: Subject) -> None:
    limits = Limits(parallel=2)
    _, one = await subject.limiter.acquire(subject.key, limits, 0)
    _, two = await subject.limiter.acquire(subject.key, limits, 0)
    third, _ = await subject.limiter.acquire(subject.key, limits, 0)
    assert third.reason == "parallel" and third.retry_after_s == 1.0
    await subject.limiter.release(one, "m", Consumed())
    assert (await subject.limiter.acquire(subject.key, limits, 0))[0].admitted
    assert not (await subject.limiter.acquire(subject.key, limits, 0))[0].admitted
    await subject.advance(LEASE_S + 0.05)  # a replica died holding both: the leases lapse
    assert (await subject.limiter.acquire(subject.key, limits, 0))[0].admitted


async def test_a_renewed_lease_outlives_its_ttl(subject: Subject) -> None:
    """A request still running renews its slot: the parallel cap holds past the lease TTL."""
    limits = Limits(parallel=1)
    _, running = await subject.limiter.acquire(subject.key, limits, 0)
    for _ in range(3):  # 3 x 0.4 s, past two TTLs, renewed each time
        await subject.advance(LEASE_S * 2 / 3)
        await subject.limiter.renew(running)
        refused, _ = await subject.limiter.acquire(subject.key, limits, 0)
        assert refused.reason == "parallel"
    await subject.advance(LEASE_S + 0.05)  # no more renewals (its replica died): it lapses
    again, ticket = await subject.limiter.acquire(subject.key, limits, 0)
    assert again.admitted
    await subject.limiter.release(running, "m", Consumed())  # a late release frees nothing new
    await subject.limiter.renew(running)  # and a late renewal brings nothing back
    assert (await subject.limiter.acquire(subject.key, limits, 0))[0].reason == "parallel"


async def test_a_dead_replicas_budget_hold_is_given_back(subject: Subject) -> None:
    """A reservation never settled (its replica died) returns to the budget once its lease
    lapses; a settlement that still arrives later is charged what was used, in full."""
    limits = Limits(budget=100)
    _, lost = await subject.limiter.acquire(subject.key, limits, 80)
    assert not (await subject.limiter.acquire(subject.key, limits, 80))[0].admitted
    await subject.advance(LEASE_S + 0.05)
    assert (await subject.limiter.usage(subject.key, limits)).budget_used == 0
    decision, ticket = await subject.limiter.acquire(subject.key, limits, 80)
    assert decision.admitted and decision.budget_used == 80
    await subject.limiter.release(ticket, "m", Consumed(10, 20, True))  # settled in time: 30
    await subject.limiter.release(lost, "m", Consumed(5, 5, True))  # late: charged 10 in full
    assert (await subject.limiter.usage(subject.key, limits)).budget_used == 40


async def test_a_renewed_budget_hold_is_kept(subject: Subject) -> None:
    limits = Limits(budget=100)
    _, running = await subject.limiter.acquire(subject.key, limits, 80)
    for _ in range(2):
        await subject.advance(LEASE_S * 2 / 3)
        await subject.limiter.renew(running)
    assert (await subject.limiter.usage(subject.key, limits)).budget_used == 80
    await subject.limiter.release(running, "m", Consumed(10, 20, True))
    assert (await subject.limiter.usage(subject.key, limits)).budget_used == 30


async def test_check_decides_without_taking(subject: Subject) -> None:
    limits = Limits(rpm=1, tpm=50, budget=100)
    for _ in range(2):
        assert (await subject.limiter.check(subject.key, limits)).admitted
    _, ticket = await subject.limiter.acquire(subject.key, limits, 10)
    refused = await subject.limiter.check(subject.key, limits)
    assert refused.reason == "requests" and refused.requests_used == 1
    await subject.limiter.release(ticket, "m", Consumed(3, 7, True))
    assert (await subject.limiter.usage(subject.key, limits)).budget_used == 10


async def test_budget_for_all_time(subject: Subject) -> None:
    limits = Limits(budget=100)
    decision, ticket = await subject.limiter.acquire(subject.key, limits, 80)
    assert decision.admitted and decision.budget_used == 80
    await subject.limiter.release(ticket, "m", Consumed(20, 10, True))
    assert (await subject.limiter.acquire(subject.key, limits, 70))[0].admitted  # 30 + 70
    refused, _ = await subject.limiter.acquire(subject.key, limits, 1)
    assert refused.reason == "budget" and refused.retry_after_s is None
    usage = await subject.limiter.usage(subject.key, limits)
    assert usage.budget_used == 100 and usage.budget_reset_s is None


async def test_budget_renews_each_period(subject: Subject) -> None:
    limits = Limits(budget=10, budget_period_s=1.0)
    await subject.advance(0.0)
    admitted, _ = await subject.limiter.acquire(subject.key, limits, 10)
    if not admitted.admitted:  # a period boundary fell in between: start again
        admitted, _ = await subject.limiter.acquire(subject.key, limits, 10)
    refused, _ = await subject.limiter.acquire(subject.key, limits, 10)
    if refused.admitted:
        pytest.skip("crossed a period boundary between two calls")
    assert refused.reason == "budget" and 0 < refused.retry_after_s <= 1.0
    await subject.advance(refused.retry_after_s + 0.02)
    assert (await subject.limiter.acquire(subject.key, limits, 10))[0].admitted


async def test_usage_per_model(subject: Subject) -> None:
    limits = Limits()
    for model, used in (("a", Consumed(3, 4, True)), ("a", Consumed(1, 1, True)),
                        ("b", Consumed(2, 0, True)), ("b", Consumed())):
        _, ticket = await subject.limiter.acquire(subject.key, limits, 0)
        await subject.limiter.release(ticket, model, used)
    usage = await subject.limiter.usage(subject.key, limits)
    assert usage.models["a"].as_dict("a") == {"model": "a", "requests": 2, "prompt_tokens": 4,
                                               "completion_tokens": 5, "total_tokens": 9}
    assert usage.models["b"].requests == 1


async def test_redis_admissions_are_atomic_under_concurrency(redis_server: RedisServer) -> None:
    """Two clients (as two replicas would have) race 40 admissions for 15 slots."""
    clients = [connect(redis_server.url) for _ in range(2)]
    limiters = [RedisLimiter(c) for c in clients]
    key, limits = "key_" + secrets.token_hex(6), Limits(rpm=15, tpm=1000, parallel=100)
    results = await asyncio.gather(*(limiters[i % 2].acquire(key, limits, 10) for i in range(40)))
    assert sum(d.admitted for d, _ in results) == 15
    assert max(d.requests_used for d, _ in results) == 15
    for client in clients:
        await client.aclose()


async def test_redis_release_is_idempotent(redis_server: RedisServer) -> None:
    redis = connect(redis_server.url)
    limiter = RedisLimiter(redis)
    key, limits = "key_" + secrets.token_hex(6), Limits(tpm=100, parallel=1)
    _, ticket = await limiter.acquire(key, limits, 50)
    for _ in range(2):  # a retried call after a lost reply
        await limiter.release(ticket, "m", Consumed(5, 5, True))
    usage = await limiter.usage(key, limits)
    assert usage.models["m"].requests == 1 and usage.models["m"].prompt_tokens == 5
    decision, _ = await limiter.acquire(key, limits, 90)
    assert decision.admitted and decision.tokens_used == 100
    await redis.aclose()
