"""OpenAI's x-ratelimit-* response headers, from an admission decision."""

from __future__ import annotations

from auth.limits import Decision, Limits


def format_duration(seconds: float) -> str:
    """OpenAI's style: `20ms`, `1.5s`, `6m0s`, `1h2m3s`."""
    seconds = max(seconds, 0.0)
    if seconds < 1:
        return f"{int(round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{secs}s"


def rate_limit_headers(limits: Limits, decision: Decision) -> dict[str, str]:
    """Headers for the limits the key has; none for unlimited dimensions."""
    headers: dict[str, str] = {}
    reset = format_duration(decision.reset_s)
    if limits.rpm:
        headers["x-ratelimit-limit-requests"] = str(limits.rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(limits.rpm - decision.requests_used, 0))
        headers["x-ratelimit-reset-requests"] = reset
    if limits.tpm:
        headers["x-ratelimit-limit-tokens"] = str(limits.tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(limits.tpm - decision.tokens_used, 0))
        headers["x-ratelimit-reset-tokens"] = reset
    return headers
