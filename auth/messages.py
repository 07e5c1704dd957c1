"""The words of a 429: what limit was hit, and whether retrying can help."""

from __future__ import annotations

from auth.headers import format_duration
from auth.limits import BUDGET, PARALLEL, REQUESTS, TOKENS, TOO_LARGE, Decision, Limits


def _reserves(reserve: int | None) -> str:
    """What the request reserves: None when it was refused before its prompt was counted."""
    if reserve is None:
        return "this request needs at least one more (prompt + max_tokens)"
    return f"this request reserves {reserve} (prompt + max_tokens)"


def refusal(limits: Limits, decision: Decision, reserve: int | None) -> tuple[str, str, bool]:
    """(message, code, final): `final` when retrying the same request cannot succeed."""
    reason = decision.reason
    if reason == REQUESTS:
        return (f"Rate limit reached for requests: this API key allows {limits.rpm} requests "
                "per minute.", "rate_limit_exceeded", False)
    if reason == TOKENS:
        return (f"Rate limit reached for tokens: this API key allows {limits.tpm} tokens per "
                f"minute, {decision.tokens_used} are in use, and {_reserves(reserve)}; unused "
                "tokens are given back when a request ends.",
                "rate_limit_exceeded", False)
    if reason == TOO_LARGE:
        return (f"Request too large: it may use {reserve} tokens (prompt + max_tokens), more "
                f"than this API key's {limits.tpm} tokens per minute. Lower max_tokens or "
                "shorten the prompt.", "request_too_large", True)
    if reason == PARALLEL:
        return (f"Too many parallel requests: this API key allows {limits.parallel} at a "
                "time.", "rate_limit_exceeded", False)
    if reason == BUDGET:
        return _budget(limits, decision, reserve)
    raise ValueError(f"unknown refusal reason {reason!r}")


def _budget(limits: Limits, decision: Decision, reserve: int | None) -> tuple[str, str, bool]:
    left = max((limits.budget or 0) - decision.budget_used, 0)
    message = (f"Token budget exhausted: this API key has {left} of its {limits.budget} tokens "
               f"left and {_reserves(reserve)}.")
    if limits.budget_period_s:
        period = format_duration(limits.budget_period_s)
        return f"{message} The budget renews every {period}.", "insufficient_quota", False
    return f"{message} Ask the administrator to raise it.", "insufficient_quota", True
