"""Keys validated against the store recently: what `--auth-fail-open` may still trust.

While the key store (Redis) is unreachable, failing open serves only keys this process
validated within the last `ttl_s` seconds, each with the record it had then (its model
allow-list, expiry and disabled flag still apply). A key never seen, one seen too long
ago, and one the store said was unknown or invalid, are refused.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from auth.keys import KeyRecord

FAIL_OPEN_TTL_S = 300.0
MAX_REMEMBERED = 100_000


@dataclass(frozen=True)
class _Seen:
    record: KeyRecord
    at: float


class RecentKeys:
    """Key records by digest, least recently validated first; bounded in age and number."""

    def __init__(self, ttl_s: float = FAIL_OPEN_TTL_S, max_entries: int = MAX_REMEMBERED,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._max = max_entries
        self._clock = clock
        self._seen: OrderedDict[str, _Seen] = OrderedDict()

    def remember(self, digest: str, record: KeyRecord) -> None:
        self._seen.pop(digest, None)
        self._seen[digest] = _Seen(record, self._clock())
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)

    def forget(self, digest: str) -> None:
        self._seen.pop(digest, None)

    def get(self, digest: str) -> KeyRecord | None:
        """The key's record if it was validated within the TTL."""
        seen = self._seen.get(digest)
        if seen is None:
            return None
        if self._clock() - seen.at > self.ttl_s:
            del self._seen[digest]
            return None
        return seen.record
