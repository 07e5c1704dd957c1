"""Per-key limits: what they are, what an admission decides, and the Limiter protocol.

Requests and tokens per minute use an exact sliding window: a log of admitted
requests with the tokens each one holds. Admission reserves prompt + max_tokens;
release reconciles the entry to the tokens actually used, so the window (and the
budget) are charged by real usage. Parallel requests are leases with a deadline,
renewed while the request runs, so a replica that dies cannot hold slots forever. The
budget is a counter per fixed period (aligned to the epoch), or one counter for all time;
what a request reserves from it is a hold with the same deadline as its lease: a hold
that expires (its replica died before settling) is given back to the budget, and a
settlement that comes after that charges what was used in full.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from auth.keys import KeyOptions

WINDOW_S = 60.0
LEASE_TTL_S = 600.0

# Why an admission was refused; each maps to a 429 message in the policy.
REQUESTS = "requests"
TOKENS = "tokens"
TOO_LARGE = "too_large"
PARALLEL = "parallel"
BUDGET = "budget"


@dataclass(frozen=True)
class Limits:
    rpm: int | None = None
    tpm: int | None = None
    parallel: int | None = None
    budget: int | None = None
    budget_period_s: float | None = None

    @classmethod
    def of(cls, options: KeyOptions) -> Limits:
        return cls(options.rpm, options.tpm, options.parallel, options.budget,
                   options.budget_period)

    @property
    def windowed(self) -> bool:
        return bool(self.rpm or self.tpm)

    @property
    def counts_tokens(self) -> bool:
        """Whether admission needs the request's token estimate."""
        return bool(self.tpm or self.budget)

    @property
    def any(self) -> bool:
        return bool(self.windowed or self.parallel or self.budget)


@dataclass(frozen=True)
class Decision:
    """The outcome of one admission, with what the x-ratelimit-* headers report."""

    admitted: bool
    reason: str | None = None
    retry_after_s: float | None = None
    requests_used: int = 0  # in the window, this request included when admitted
    tokens_used: int = 0
    reset_s: float = 0.0  # until the oldest request in the window leaves it
    budget_window: int = 0
    budget_used: int = 0
    budget_reset_s: float | None = None


@dataclass(frozen=True)
class Ticket:
    """What release() needs to undo or reconcile an admission."""

    key_id: str
    lease_id: str
    reserved: int
    limits: Limits
    budget_window: int = 0


@dataclass(frozen=True)
class Consumed:
    """What a request really used. `counted`: it reached the model (counts as a request)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    counted: bool = False

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class ModelUsage:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self, model: str) -> dict[str, int | str]:
        return {"model": model, "requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass
class KeyUsage:
    models: dict[str, ModelUsage] = field(default_factory=dict)
    budget_used: int = 0
    budget_reset_s: float | None = None


def budget_window(now_s: float, period_s: float | None) -> int:
    return int(now_s // period_s) if period_s else 0


def budget_reset(now_s: float, period_s: float | None) -> float | None:
    if not period_s:
        return None
    return (budget_window(now_s, period_s) + 1) * period_s - now_s


class Limiter(Protocol):
    @property
    def lease_ttl_s(self) -> float:
        """How long a lease (parallel slot, budget hold) lives unless renewed."""
        ...

    async def check(self, key_id: str, limits: Limits) -> Decision:
        """Whether a request of at least one token would be admitted now; nothing taken.
        Lets a refusal come before the prompt is counted; `acquire` still decides."""
        ...

    async def acquire(self, key_id: str, limits: Limits, reserve: int) -> tuple[Decision, Ticket]:
        """Admit one request holding `reserve` tokens, or refuse it (nothing taken)."""
        ...

    async def renew(self, ticket: Ticket) -> None:
        """Push the lease's deadline (and its budget hold's) a TTL away, if it still exists."""
        ...

    async def release(self, ticket: Ticket, model: str, used: Consumed) -> None:
        """End an admitted request: free its slot, reconcile tokens, record usage."""
        ...

    async def usage(self, key_id: str, limits: Limits) -> KeyUsage: ...

    async def close(self) -> None: ...

    def describe(self) -> str: ...
