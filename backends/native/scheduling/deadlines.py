"""--queue-timeout and --request-timeout: which requests have run out of time."""

from __future__ import annotations

from collections.abc import Iterator

from backends.native.scheduling.sequence import Sequence

QUEUE_TIMEOUT = "queue_timeout"  # the stop_reason of a request ended while still waiting
REQUEST_TIMEOUT = "request_timeout"  # ... of one that took longer than --request-timeout


def expired(
    groups: dict[str, list[Sequence]], now: float, queue_timeout: float | None,
    request_timeout: float | None,
) -> Iterator[tuple[str, str]]:
    """(request id, reason) of each request past a deadline. A request is queued until its
    first step (`Sequence.first_scheduled`); both clocks start at its arrival."""
    for request_id, choices in list(groups.items()):
        if not choices:
            continue
        waited = now - choices[0].arrival_time
        if request_timeout is not None and waited > request_timeout:
            yield request_id, REQUEST_TIMEOUT
        elif (queue_timeout is not None and waited > queue_timeout
              and all(c.first_scheduled is None for c in choices)):
            yield request_id, QUEUE_TIMEOUT
