"""Failure isolation for engine steps, and the test-only fault hook.

A step that raises (a bad kernel, an out-of-memory error, NaNs caught by a check) is treated
as not having happened: its sequences drop their KV blocks (uncached: they may hold half-written
K/V), go back to the front of the queue, and are then run one at a time (the scheduler's
`solo` queue) until each has recomputed what it had. A sequence that fails alone is the
culprit: only its request fails. Recompute gives the same greedy tokens, as preemption does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from backends.native.scheduling.scheduler import ScheduledBatch
from backends.native.scheduling.sequence import Sequence, SequenceStatus


class InjectedFault(RuntimeError):
    """Raised by the test hook (EngineConfig.fault_request_ids) inside a step."""


def raise_injected_fault(faults: Iterable[str], batch: ScheduledBatch) -> None:
    """Raise when a request named in `faults` is in the step (the caller checks that
    `faults` is non-empty first, so production steps pay one falsy test)."""
    wanted = set(faults)
    hit = sorted({seq.group_id for seq in batch.seqs} & wanted)
    if hit:
        raise InjectedFault(f"injected fault for request(s) {', '.join(hit)}")


def suspects(batch: ScheduledBatch, groups: dict[str, list[Sequence]]) -> list[Sequence]:
    """The sequences a failed step leaves in doubt: every unfinished, scheduled choice of its
    requests (choices forked in that step share its blocks), in batch order."""
    seqs: list[Sequence] = []
    for seq in batch.seqs:
        for choice in groups.get(seq.group_id, [seq]):
            fresh = choice.status is not SequenceStatus.NEW and choice not in seqs
            if fresh and not choice.is_finished:
                seqs.append(choice)
    return seqs


def settle(masks: Future[Any] | None) -> None:
    """Wait out a failed step's grammar mask fill: a retry must not fill the same matchers
    while it still runs."""
    if masks is not None:
        with contextlib.suppress(Exception):
            masks.result()
