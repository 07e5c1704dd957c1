"""Whose fault an upstream timeout is.

The deployment's (the upstream is down or stuck): the failure counts toward its cooldown and
the request moves on to another deployment. The request's own: neither counted nor moved on
(elsewhere it would only cost the same time again), answered 504 `timeout_error`, so that
requests no upstream can serve in time cannot take a deployment out for everyone:
- it ran out of the deployment's `request_timeout` (the cap on a whole request);
- the upstream sent nothing within `read_timeout` while it answers a small generation at
  once (a prompt too large for it to start on in time).
The small generation is asked at most once at a time, and its answer kept for a few seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from backends.base import DeploymentError, RequestError

LIVENESS_TIMEOUT_S = 10.0  # the most the small generation may take
VERDICT_TTL_S = 5.0  # how long its answer stands for other timed-out requests
TIMED_OUT = "upstream_timeout"


class TimeoutJudge:
    def __init__(
        self, request_timeout: float, read_timeout: float,
        answers: Callable[[float], Awaitable[bool]], clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._request_timeout = request_timeout
        self._read_timeout = read_timeout
        self._answers = answers  # does the upstream answer a small generation in time?
        self._clock = clock
        self._check: asyncio.Future[bool] | None = None
        self._verdict: tuple[float, bool] | None = None  # (when, it answered)

    async def judge(self, exc: DeploymentError, started: float, *, sent: bool) -> Exception:
        """`exc` itself when the deployment is to blame, else the request's own 504."""
        if exc.code != TIMED_OUT:
            return exc
        if self._clock() - started >= self._request_timeout * 0.99:
            return RequestError(
                f"the request took longer than this deployment allows a request "
                f"({self._request_timeout:g} s, its `request_timeout`) and was stopped",
                code="request_timeout", status_code=504, error_type="timeout_error")
        if sent or not await self._upstream_answers():
            return exc
        return RequestError(
            f"the upstream did not start on this request within {self._read_timeout:g} s "
            "while it answers others: the request is too large for it to begin in time "
            "(a shorter prompt may pass)",
            code=TIMED_OUT, status_code=504, error_type="timeout_error")

    async def _upstream_answers(self) -> bool:
        if self._verdict is not None and self._clock() - self._verdict[0] < VERDICT_TTL_S:
            return self._verdict[1]
        if self._check is None or self._check.done():
            timeout = min(self._read_timeout, LIVENESS_TIMEOUT_S)
            self._check = asyncio.ensure_future(self._answers(timeout))
        answered = await asyncio.shield(self._check)
        self._verdict = (self._clock(), answered)
        return answered
