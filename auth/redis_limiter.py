"""Limits shared by every replica: one atomic Lua script per admission and per release."""

from __future__ import annotations

import secrets

from redis.asyncio import Redis

from auth.limits import (
    LEASE_TTL_S,
    WINDOW_S,
    Consumed,
    Decision,
    KeyUsage,
    Limits,
    ModelUsage,
    Ticket,
    budget_reset,
)
from auth.lua import ACQUIRE, BUDGET, RELEASE, RENEW
from auth.redis_conn import reachable


def _keys(key_id: str) -> list[str]:
    tag = f"sy:{{{key_id}}}"
    return [f"{tag}:log", f"{tag}:amounts", f"{tag}:tokens", f"{tag}:inflight", f"{tag}:budget",
            f"{tag}:usage", f"{tag}:held", f"{tag}:holds"]


def _ms(seconds: float | None) -> int:
    return int(round((seconds or 0) * 1000))


class RedisLimiter:
    def __init__(
        self, redis: Redis, window_s: float = WINDOW_S, lease_ttl_s: float = LEASE_TTL_S,
        where: str = "redis",
    ) -> None:
        self._redis = redis
        self._window_ms = _ms(window_s)
        self._lease_ttl_ms = _ms(lease_ttl_s)
        self._acquire = redis.register_script(ACQUIRE)
        self._release = redis.register_script(RELEASE)
        self._renew = redis.register_script(RENEW)
        self._budget = redis.register_script(BUDGET)
        self._where = where

    @property
    def lease_ttl_s(self) -> float:
        return self._lease_ttl_ms / 1000

    async def check(self, key_id: str, limits: Limits) -> Decision:
        if not limits.any:
            return Decision(admitted=True)
        return (await self._decide(key_id, limits, 1, dry=True))[0]

    async def acquire(self, key_id: str, limits: Limits, reserve: int) -> tuple[Decision, Ticket]:
        if not limits.any:  # nothing to count: no round trip
            lease = secrets.token_hex(8)
            return Decision(admitted=True), Ticket(key_id, lease, reserve, limits)
        return await self._decide(key_id, limits, reserve, dry=False)

    async def _decide(self, key_id: str, limits: Limits, reserve: int, *, dry: bool,
                      ) -> tuple[Decision, Ticket]:
        lease = secrets.token_hex(8)
        args = [lease, reserve, limits.rpm or 0, limits.tpm or 0, limits.parallel or 0,
                limits.budget or 0, _ms(limits.budget_period_s), self._lease_ttl_ms,
                self._window_ms, int(dry)]
        with reachable():
            out = await self._acquire(keys=_keys(key_id), args=args)
        reason, retry_ms, count, used, reset_ms, window, spent, now_ms = out
        retry = int(retry_ms) / 1000 if reason and int(retry_ms) >= 0 else None
        decision = Decision(
            admitted=not reason, reason=reason or None, retry_after_s=retry,
            requests_used=int(count), tokens_used=int(used), reset_s=max(int(reset_ms), 0) / 1000,
            budget_window=int(window), budget_used=int(spent),
            budget_reset_s=budget_reset(int(now_ms) / 1000, limits.budget_period_s),
        )
        return decision, Ticket(key_id, lease, reserve, limits, int(window))

    async def release(self, ticket: Ticket, model: str, used: Consumed) -> None:
        args = [ticket.lease_id, ticket.reserved, used.total_tokens, ticket.budget_window,
                int(bool(ticket.limits.budget)), model, used.prompt_tokens,
                used.completion_tokens, int(used.counted), self._lease_ttl_ms]
        keys = [*_keys(ticket.key_id), f"sy:{{{ticket.key_id}}}:settled:{ticket.lease_id}"]
        with reachable():
            await self._release(keys=keys, args=args)

    async def renew(self, ticket: Ticket) -> None:
        with reachable():
            await self._renew(keys=_keys(ticket.key_id),
                              args=[ticket.lease_id, self._lease_ttl_ms])

    async def usage(self, key_id: str, limits: Limits) -> KeyUsage:
        keys = _keys(key_id)
        with reachable():
            counters = await self._redis.hgetall(keys[5])
            budget = await self._budget(keys=keys) if limits.budget else [None, None]
            now_s, micros = await self._redis.time()
        now = int(now_s) + int(micros) / 1e6
        models: dict[str, ModelUsage] = {}
        for name, value in counters.items():
            counter, _, model = name.partition(":")
            setattr(models.setdefault(model, ModelUsage()), counter, int(value))
        period_ms = _ms(limits.budget_period_s)
        current = int(now * 1000) // period_ms if period_ms else 0
        spent = int(budget[1]) if budget[0] is not None and int(budget[0]) == current else 0
        return KeyUsage(models, spent, budget_reset(now, limits.budget_period_s))

    async def close(self) -> None:
        return None

    def describe(self) -> str:
        return self._where
