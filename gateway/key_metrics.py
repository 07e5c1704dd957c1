"""Per-key Prometheus series: tokens used and requests the key's limits refused.

One series per API key that has served traffic in this process, labelled by key id (never
the key). Key ids are made by operators, not clients, so the label set grows with the keys an
operator creates; a revoked key's series are dropped here at once (other replicas drop theirs
at restart). Redis stays the record of usage (`/admin/keys/{id}/usage`); these are for
dashboards and alerts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

TOKEN_KINDS = ("prompt", "completion")


class KeyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.tokens = Counter(
            "switchyard_key_tokens", "Tokens used by an API key, by kind (prompt, completion)",
            ["key_id", "kind"], registry=registry)
        self.refused = Counter(
            "switchyard_key_rate_limited", "Requests an API key's limits refused, by limit "
            "(requests, tokens, parallel, budget, too_large)", ["key_id", "limit"],
            registry=registry)
        self._limits: dict[str, set[str]] = {}  # key id -> limits it has a series for

    def record_usage(self, key_id: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.tokens.labels(key_id, "prompt").inc(prompt_tokens)
        self.tokens.labels(key_id, "completion").inc(completion_tokens)

    def record_refusal(self, key_id: str, limit: str) -> None:
        self.refused.labels(key_id, limit).inc()
        self._limits.setdefault(key_id, set()).add(limit)

    def forget(self, key_id: str) -> None:
        """Drop a revoked key's series."""
        for kind in TOKEN_KINDS:
            self._remove(self.tokens, key_id, kind)
        for limit in self._limits.pop(key_id, set()):
            self._remove(self.refused, key_id, limit)

    @staticmethod
    def _remove(counter: Counter, *labels: str) -> None:
        try:
            counter.remove(*labels)
        except KeyError:  # never recorded
            pass
