"""Limits for one gateway process. No awaits inside a decision, so asyncio makes it atomic.

The same algorithm as the Redis Lua scripts (auth/redis_limiter.py), in Python.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from auth.limits import (
    BUDGET,
    LEASE_TTL_S,
    PARALLEL,
    REQUESTS,
    TOKENS,
    TOO_LARGE,
    WINDOW_S,
    Consumed,
    Decision,
    KeyUsage,
    Limits,
    ModelUsage,
    Ticket,
    budget_reset,
    budget_window,
)


@dataclass
class _Hold:
    """What an admission took from the budget, until it settles or its deadline passes."""

    deadline: float
    window: int
    tokens: int


@dataclass
class _KeyState:
    log: OrderedDict[str, tuple[float, int]] = field(default_factory=OrderedDict)  # admission order
    tokens: int = 0
    inflight: dict[str, float] = field(default_factory=dict)  # lease -> deadline
    budget_window: int = 0
    budget_used: int = 0
    holds: dict[str, _Hold] = field(default_factory=dict)  # lease -> its budget hold
    usage: dict[str, ModelUsage] = field(default_factory=dict)


class MemoryLimiter:
    def __init__(
        self, clock: Callable[[], float] = time.time, window_s: float = WINDOW_S,
        lease_ttl_s: float = LEASE_TTL_S,
    ) -> None:
        self._clock = clock
        self._window = window_s
        self._lease_ttl = lease_ttl_s
        self._keys: dict[str, _KeyState] = {}

    def _state(self, key_id: str) -> _KeyState:
        return self._keys.setdefault(key_id, _KeyState())

    def _expire(self, state: _KeyState, now: float) -> None:
        while state.log:
            lease, (at, tokens) = next(iter(state.log.items()))
            if at > now - self._window:
                break
            del state.log[lease]
            state.tokens -= tokens
        for lease in [k for k, deadline in state.inflight.items() if deadline <= now]:
            del state.inflight[lease]
        for lease in [k for k, hold in state.holds.items() if hold.deadline <= now]:
            hold = state.holds.pop(lease)
            if hold.window == state.budget_window:
                state.budget_used -= hold.tokens

    def _budget_used(self, state: _KeyState, limits: Limits, now: float) -> int:
        window = budget_window(now, limits.budget_period_s)
        return state.budget_used if state.budget_window == window else 0

    def _tokens_free_in(self, state: _KeyState, need: int, tpm: int, now: float) -> float:
        freed = 0
        for at, tokens in state.log.values():
            freed += tokens
            if state.tokens - freed + need <= tpm:
                return at + self._window - now
        return self._window

    def _refusal(self, state: _KeyState, limits: Limits, reserve: int, now: float,
                 ) -> tuple[str, float | None] | None:
        oldest = next(iter(state.log.values()))[0] if state.log else now
        if limits.tpm and reserve > limits.tpm:
            return TOO_LARGE, self._window
        if limits.rpm and len(state.log) >= limits.rpm:
            return REQUESTS, oldest + self._window - now
        if limits.tpm and state.tokens + reserve > limits.tpm:
            return TOKENS, self._tokens_free_in(state, reserve, limits.tpm, now)
        if limits.parallel and len(state.inflight) >= limits.parallel:
            return PARALLEL, 1.0
        if limits.budget and self._budget_used(state, limits, now) + reserve > limits.budget:
            return BUDGET, budget_reset(now, limits.budget_period_s)
        return None

    def _take(self, state: _KeyState, limits: Limits, lease: str, reserve: int, now: float,
              ) -> None:
        if limits.windowed:
            state.log[lease] = (now, reserve)
            state.tokens += reserve
        if limits.parallel:
            state.inflight[lease] = now + self._lease_ttl
        if limits.budget:
            state.budget_used = self._budget_used(state, limits, now) + reserve
            state.budget_window = budget_window(now, limits.budget_period_s)
            state.holds[lease] = _Hold(now + self._lease_ttl, state.budget_window, reserve)

    @property
    def lease_ttl_s(self) -> float:
        return self._lease_ttl

    async def check(self, key_id: str, limits: Limits) -> Decision:
        return self._decide(key_id, limits, 1, take=False)[0]

    async def acquire(self, key_id: str, limits: Limits, reserve: int) -> tuple[Decision, Ticket]:
        return self._decide(key_id, limits, reserve, take=True)

    def _decide(self, key_id: str, limits: Limits, reserve: int, *, take: bool,
                ) -> tuple[Decision, Ticket]:
        now = self._clock()
        state = self._state(key_id)
        self._expire(state, now)
        refusal = self._refusal(state, limits, reserve, now)
        lease = secrets.token_hex(8)
        if refusal is None and take:
            self._take(state, limits, lease, reserve, now)
        oldest = next(iter(state.log.values()))[0] if state.log else now
        decision = Decision(
            admitted=refusal is None, reason=refusal[0] if refusal else None,
            retry_after_s=refusal[1] if refusal else None,
            requests_used=len(state.log), tokens_used=state.tokens,
            reset_s=max(oldest + self._window - now, 0.0) if state.log else 0.0,
            budget_window=budget_window(now, limits.budget_period_s),
            budget_used=self._budget_used(state, limits, now),
            budget_reset_s=budget_reset(now, limits.budget_period_s),
        )
        ticket = Ticket(key_id, lease, reserve, limits, decision.budget_window)
        return decision, ticket

    async def release(self, ticket: Ticket, model: str, used: Consumed) -> None:
        state = self._state(ticket.key_id)
        state.inflight.pop(ticket.lease_id, None)
        delta = used.total_tokens - ticket.reserved
        entry = state.log.get(ticket.lease_id)
        if entry is not None and delta:
            state.log[ticket.lease_id] = (entry[0], entry[1] + delta)
            state.tokens += delta
        if ticket.limits.budget:
            held = state.holds.pop(ticket.lease_id, None) is not None
            # A hold that expired was given back: the tokens used are charged in full.
            if state.budget_window == ticket.budget_window:
                state.budget_used += delta if held else used.total_tokens
        counters = state.usage.setdefault(model, ModelUsage())
        counters.requests += int(used.counted)
        counters.prompt_tokens += used.prompt_tokens
        counters.completion_tokens += used.completion_tokens

    async def renew(self, ticket: Ticket) -> None:
        state = self._state(ticket.key_id)
        deadline = self._clock() + self._lease_ttl
        if ticket.lease_id in state.inflight:
            state.inflight[ticket.lease_id] = deadline
        hold = state.holds.get(ticket.lease_id)
        if hold is not None:
            hold.deadline = deadline

    async def usage(self, key_id: str, limits: Limits) -> KeyUsage:
        now = self._clock()
        state = self._state(key_id)
        self._expire(state, now)
        models = {m: ModelUsage(u.requests, u.prompt_tokens, u.completion_tokens)
                  for m, u in state.usage.items()}
        return KeyUsage(models, self._budget_used(state, limits, now),
                        budget_reset(now, limits.budget_period_s))

    async def close(self) -> None:
        return None

    def describe(self) -> str:
        return "memory (this process only; replicas do not share limits)"
