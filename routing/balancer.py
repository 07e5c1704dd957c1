"""Balancer: which deployment takes the next request.

Among the deployments in rotation (and not already tried by this request), only the
best (lowest) priority is considered; within it the least loaded relative to its
weight, i.e. the least `(in_flight + 1) / weight`, so concurrent load spreads in
proportion to the weights. Ties go round robin.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from routing.deployment import Deployment


def _load(deployment: Deployment) -> float:
    return (deployment.in_flight + 1) / deployment.weight


class Balancer:
    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self, deployments: Sequence[Deployment], exclude: Collection[Deployment] = (),
    ) -> Deployment | None:
        """The deployment for the next attempt, or None when none is in rotation."""
        tied = best_tier(deployments, exclude)
        if not tied:
            return None
        lowest = min(_load(d) for d in tied)
        tied = [d for d in tied if math.isclose(_load(d), lowest)]
        pick = tied[self._turn % len(tied)]
        self._turn += 1
        return pick


def best_tier(
    deployments: Sequence[Deployment], exclude: Collection[Deployment] = (),
) -> list[Deployment]:
    """The in-rotation deployments of the best priority, `exclude` left out."""
    candidates = [d for d in deployments if d.in_rotation and d not in exclude]
    if not candidates:
        return []
    best = min(d.priority for d in candidates)
    return [d for d in candidates if d.priority == best]
