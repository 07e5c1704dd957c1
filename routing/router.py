"""ModelRouter: one model's deployments behind the Backend contract.

The gateway calls a router exactly as it would call one backend. `generate()` picks a
deployment (routing/balancer.py), opens it and pulls its first event. Before that first
event, a `DeploymentError` or `BackendUnavailable` moves the request to the next
deployment (never one it tried; lower priorities once the best one's are spent), and
counts toward the failed deployment's cooldown; a local engine that is full (429
`overloaded`) also hands the request on, without counting. Once an event has gone to the
gateway the request is never retried: a failure then ends it. Any other `RequestError` (a
client mistake, an upstream 4xx, or an upstream's error event that blames the request, before
the first event or after it) is neither retried nor counted as a failure. With `n > 1`
choices the events pass through until every choice has finished; an "error" finish in any
choice counts as the deployment's failure.

A model has one task: a router of an embedding model (`task="embed"`) refuses generation and
its token counts with a 400 naming the model and its task (whatever route asked), and routes
`embed()` calls, one answer each, with the same balancing, fallbacks and cooldowns; a
generation model refuses `embed()` alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from backends.base import (
    Backend,
    BackendStats,
    BackendUnavailable,
    DeploymentError,
    GenerationEvent,
    GenerationRequest,
    Health,
    ModelInfo,
    RequestError,
    StepTiming,
)
from backends.embeddings import (
    EmbeddingBackend,
    EmbeddingRequest,
    Embeddings,
    Task,
)
from backends.events import close_events
from routing.balancer import Balancer, best_tier
from routing.deployment import Deployment
from routing.errors import NoHealthyDeployment, task_mismatch
from routing.health import current
from routing.policy import RoutingPolicy
from routing.stats import Outcome

log = logging.getLogger("switchyard.routing")
Events = AsyncIterator[GenerationEvent]
T = TypeVar("T")
RETRYABLE = (DeploymentError, BackendUnavailable)
OVERLOADED = "overloaded"  # a local engine at --max-concurrent-requests (RequestError 429)
# Refusals that say "busy, not broken": the request moves on to another deployment, no cooldown.
BUSY_CODES = frozenset({OVERLOADED, "queue_timeout"})
# Told the name of the deployment that answers the current request (the gateway's access
# line); the gateway sets it per request.
served_by: ContextVar[Callable[[str], None] | None] = ContextVar(
    "switchyard_served_by", default=None)


@dataclass
class _Attempt:
    """One try of a request on one deployment (counted in flight until it ends)."""

    deployment: Deployment
    started: float
    events: Events | None = None
    first: GenerationEvent | None = None


class _Choices:
    """Which of a request's `n` choices have finished: with n > 1 the events of the choices
    interleave, and the request ends only when every one has its finish reason."""

    def __init__(self, n: int) -> None:
        self.n = max(n, 1)
        self.finished: set[int] = set()
        self.errored = False

    def saw(self, event: GenerationEvent) -> None:
        if event.finish_reason is not None:
            self.finished.add(event.index)
            self.errored = self.errored or event.finish_reason == "error"

    @property
    def all_finished(self) -> bool:
        return len(self.finished) >= self.n


class ModelRouter:
    """Routes one model's requests over its deployments; implements `Backend`."""

    def __init__(
        self, model: str, deployments: Sequence[Deployment], policy: RoutingPolicy,
        clock: Callable[[], float] = time.monotonic, task: Task = "generate",
    ) -> None:
        if not deployments:
            raise ValueError(f"model {model!r} has no deployments")
        names = [d.name for d in deployments]
        if len(set(names)) != len(names):
            raise ValueError(f"model {model!r}: deployment names must be unique, got {names}")
        self.model = model
        self.deployments = tuple(deployments)
        self.policy = policy
        self.task = task
        self._clock = clock
        self._balancer = Balancer()

    def require(self, task: Task) -> None:
        """Refuse (a 400 naming the model and its task) what this model's task does not do."""
        if task != self.task:
            raise task_mismatch(self.model, self.task)

    # -- generation -------------------------------------------------------------------

    def generate(self, req: GenerationRequest) -> Events:
        return self._generate(req)

    async def _generate(self, req: GenerationRequest) -> Events:
        self.require("generate")
        attempt = await self._open(req)
        assert attempt.events is not None
        outcome: Outcome | None = None
        choices = _Choices(req.sampling.n)
        try:
            event = attempt.first
            while event is not None:
                choices.saw(event)
                yield event
                if choices.all_finished:
                    break
                event = await anext(attempt.events, None)
        except RETRYABLE as exc:  # after the first event: never retried
            self._failed(attempt.deployment, exc)
            outcome = "failure"
            raise
        except RequestError:
            outcome = "client_error"
            raise
        except Exception:
            outcome = "failure"
            raise
        finally:
            if outcome is None and (choices.all_finished or attempt.first is None):
                outcome = "failure" if choices.errored else "success"
            await self._end(attempt, outcome)

    async def _open(self, req: GenerationRequest) -> _Attempt:
        """The first attempt that yields a first event (or ends cleanly), with fallbacks."""
        async def first_event(attempt: _Attempt) -> None:
            attempt.events = attempt.deployment.backend.generate(req)
            attempt.first = await anext(attempt.events, None)

        attempt, _ = await self._first(first_event)
        return attempt

    async def _first(self, run: Callable[[_Attempt], Awaitable[T]]) -> tuple[_Attempt, T]:
        """The first attempt whose `run` succeeds, still in flight (the caller ends it), and
        what it returned. A failure moves on to the next deployment, as does a busy refusal
        (no cooldown); a client error ends the request."""
        tried: list[Deployment] = []
        failed: tuple[_Attempt, Exception] | None = None
        while True:
            deployment = self._balancer.choose(self.deployments, tried)
            if failed is not None:
                await self._end(failed[0], "fallback" if deployment else "failure")
                if deployment is None:
                    raise failed[1]
                log.warning("model %s: deployment %s failed (%s); trying %s", self.model,
                            failed[0].deployment.name, failed[1], deployment.name)
            if deployment is None:
                raise self._no_healthy()
            tried.append(deployment)
            attempt = _Attempt(deployment, self._clock())
            deployment.in_flight += 1
            try:
                result = await run(attempt)
                if (listener := served_by.get()) is not None:
                    listener(deployment.name)
                return attempt, result
            except RETRYABLE as exc:
                self._failed(deployment, exc)
                failed = (attempt, exc)
            except RequestError as exc:
                if exc.code not in BUSY_CODES:
                    await self._end(attempt, "client_error")
                    raise
                failed = (attempt, exc)  # busy, not failing: try another, no cooldown
            except Exception:
                await self._end(attempt, "failure")
                raise
            except BaseException:  # cancelled: the client left
                await self._end(attempt, None)
                raise

    # -- embeddings: one answer per call ----------------------------------------------

    async def embed(self, req: EmbeddingRequest) -> Embeddings:
        self.require("embed")
        return await self.call(lambda backend: _embedder(backend).embed(req))

    def count_embedding_tokens(self, req: EmbeddingRequest) -> int:
        self.require("embed")
        return _embedder(self.preferred().backend).count_embedding_tokens(req)

    async def call(self, run: Callable[[Backend], Awaitable[T]]) -> T:
        """`run(backend)` on a deployment, with the fallbacks of a generation's opening."""
        attempt, result = await self._first(lambda attempt: run(attempt.deployment.backend))
        await self._end(attempt, "success")
        return result

    def _failed(self, deployment: Deployment, exc: Exception) -> None:
        if deployment.failed(self._clock(), self.policy, str(exc) or type(exc).__name__):
            log.warning("model %s: deployment %s %s", self.model, deployment.name,
                        deployment.detail)

    async def _end(self, attempt: _Attempt, outcome: Outcome | None) -> None:
        deployment = attempt.deployment
        deployment.in_flight -= 1
        if outcome == "success":
            deployment.succeeded()
        if outcome is not None:
            seconds = None if outcome == "client_error" else self._clock() - attempt.started
            deployment.stats.record(outcome, seconds)
        await close_events(attempt.events)

    def _no_healthy(self) -> NoHealthyDeployment:
        now = self._clock()
        waits = [d.retry_at - now for d in self.deployments if not d.in_rotation]
        return NoHealthyDeployment(self.model, min(waits, default=1.0))

    # -- the rest of the Backend contract ---------------------------------------------

    def preferred(self) -> Deployment:
        """The deployment asked for token counts and model info: the best one in rotation."""
        tier = best_tier(self.deployments)
        if tier:
            return tier[0]
        return min(self.deployments, key=lambda d: d.priority)

    def count_tokens(self, req: GenerationRequest) -> int:
        self.require("generate")
        return self.preferred().backend.count_tokens(req)

    def tokenize(self, req: GenerationRequest) -> list[int]:
        tokenize = getattr(self.preferred().backend, "tokenize", None)
        if tokenize is None:  # optional for a backend: /tokenize and TGI's `truncate` need it
            raise RequestError("this model's backend cannot tokenize (needed by /tokenize and "
                               "TGI's `truncate`)")
        return tokenize(req)

    def detokenize(self, token_ids: list[int]) -> str:
        detokenize = getattr(self.preferred().backend, "detokenize", None)
        if detokenize is None:
            raise RequestError("this model's backend cannot detokenize", param="tokens")
        return detokenize(token_ids)

    def info(self) -> ModelInfo:
        return self.preferred().backend.info()

    def backends(self) -> list[Backend]:
        """The distinct backends behind this model."""
        seen: dict[int, Backend] = {}
        for d in self.deployments:
            seen.setdefault(id(d.backend), d.backend)
        return list(seen.values())

    async def start(self) -> None:
        for backend in self.backends():
            await backend.start()

    async def close(self) -> None:
        for backend in reversed(self.backends()):
            await backend.close()

    async def health(self) -> Health:
        """Ready when a deployment in rotation is ready (by what each backend knows now: an
        upstream one is not asked; the background checker asks it)."""
        details = []
        for d in self.deployments:
            health = await current(d.backend.health, self.policy.probe_timeout)
            if health.ready and d.in_rotation:
                return Health(ready=True)
            details.append(f"{d.name}: {d.detail or health.detail or 'not ready'}")
        return Health(ready=False, detail="; ".join(details))

    def stats(self) -> BackendStats:
        """Every backend's gauges and counters, summed."""
        results: list[BackendStats] = []
        backends = self.backends()
        for backend in backends:
            try:
                results.append(backend.stats())
            except Exception:  # one broken deployment must not hide the others' gauges
                if len(backends) == 1:
                    raise
                log.exception("model %s: stats() of a deployment failed", self.model)
        return summed_stats(results)

    def drain_step_timings(self) -> list[StepTiming]:
        steps: list[StepTiming] = []
        for backend in self.backends():
            drain = getattr(backend, "drain_step_timings", None)
            if drain is not None:
                steps.extend(drain())
        return steps


def _embedder(backend: Backend) -> EmbeddingBackend:
    if not isinstance(backend, EmbeddingBackend):
        raise RequestError(f"this deployment's backend ({type(backend).__name__}) cannot "
                           "compute embeddings", code="unsupported_endpoint")
    return backend


def summed_stats(results: list[BackendStats]) -> BackendStats:
    """Deployments' stats added field by field (per-expert counts expert by expert)."""
    total: dict[str, Any] = {}
    for stats in results:
        for name, value in vars(stats).items():
            if isinstance(value, tuple):
                mine = total.get(name, ())
                width = max(len(mine), len(value))
                padded = [(*v, *(0,) * (width - len(v))) for v in (mine, value)]
                total[name] = tuple(a + b for a, b in zip(*padded, strict=True))
            else:
                total[name] = total.get(name, 0) + value
    return BackendStats(**total)
