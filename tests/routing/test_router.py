"""ModelRouter: fallbacks before the first event only, cooldowns, client errors, in-flight."""

from __future__ import annotations

import asyncio

import pytest

from backends.base import (
    BackendStats,
    BackendUnavailable,
    DeploymentError,
    GenerationEvent,
    GenerationRequest,
    RequestError,
    SamplingParams,
)
from routing import (
    Deployment,
    DeploymentState,
    ModelRouter,
    NoHealthyDeployment,
    RoutingPolicy,
)
from routing.router import summed_stats
from tests.routing.fakes import Clock, FakeBackend

POLICY = RoutingPolicy(cooldown_after_failures=2, cooldown_seconds=30, health_check_interval=10)


def _router(*backends: FakeBackend, priorities: tuple[int, ...] = (), clock: Clock | None = None,
            ) -> ModelRouter:
    deployments = [
        Deployment(b.name, b, priority=priorities[i] if priorities else 0)
        for i, b in enumerate(backends)
    ]
    return ModelRouter("m", deployments, POLICY, clock=clock or Clock())


async def _run(router: ModelRouter, rid: str = "r") -> list[GenerationEvent]:
    return [e async for e in router.generate(GenerationRequest(request_id=rid, prompt="hi"))]


def _outcomes(router: ModelRouter, name: str) -> dict[str, int]:
    d = next(d for d in router.deployments if d.name == name)
    return {k: v for k, v in d.stats.outcomes.items() if v}


async def test_falls_back_before_the_first_event() -> None:
    bad = FakeBackend("bad", fail_open=DeploymentError("connect refused"))
    good = FakeBackend("good")
    router = _router(bad, good)
    for i in range(2):  # round robin would alternate; the failing one falls back each time
        events = await _run(router, f"r{i}")
        assert [e.text for e in events] == ["good"] * 3
    assert _outcomes(router, "bad") == {"fallback": 2}
    assert _outcomes(router, "good") == {"success": 2}
    assert all(d.in_flight == 0 for d in router.deployments)
    assert router.deployments[0].state is DeploymentState.COOLING_DOWN  # 2 failures in a row


async def test_backend_unavailable_also_falls_back() -> None:
    router = _router(FakeBackend("loading", fail_open=BackendUnavailable("loading")),
                     FakeBackend("ok"))
    assert {e.text for e in await _run(router)} == {"ok"}


async def test_lower_priority_after_every_best_one_failed() -> None:
    a = FakeBackend("a", fail_open=DeploymentError("a down"))
    b = FakeBackend("b", fail_open=DeploymentError("b down", status_code=504))
    spare = FakeBackend("spare")
    router = _router(spare, a, b, priorities=(1, 0, 0))
    assert {e.text for e in await _run(router)} == {"spare"}
    assert (a.calls, b.calls, spare.calls) == (1, 1, 1)


async def test_all_failed_answers_the_last_error() -> None:
    a = FakeBackend("a", fail_open=DeploymentError("a down"))
    b = FakeBackend("b", fail_open=DeploymentError("b timed out", status_code=504))
    router = _router(a, b)
    with pytest.raises(DeploymentError) as caught:
        await _run(router)
    assert caught.value.status_code == 504 and not isinstance(caught.value, NoHealthyDeployment)
    assert _outcomes(router, "a") == {"fallback": 1}
    assert _outcomes(router, "b") == {"failure": 1}


async def test_never_retried_after_the_first_event() -> None:
    broken = FakeBackend("broken", fail_after=DeploymentError("upstream died"))
    other = FakeBackend("other")
    router = _router(broken, other)
    got: list[str] = []
    with pytest.raises(DeploymentError, match="upstream died"):
        async for event in router.generate(GenerationRequest(request_id="r", prompt="x")):
            got.append(event.text)
    assert got == ["broken"] and other.calls == 0
    assert _outcomes(router, "broken") == {"failure": 1}
    assert router.deployments[0].consecutive_failures == 1


async def test_client_errors_are_not_retried_nor_counted() -> None:
    refusing = FakeBackend("refusing", fail_open=RequestError("prompt too long", status_code=400))
    router = _router(refusing, FakeBackend("other"))
    with pytest.raises(RequestError):
        await _run(router)
    assert router.deployments[0].consecutive_failures == 0
    assert _outcomes(router, "refusing") == {"client_error": 1}
    assert router.deployments[1].stats.outcomes["success"] == 0


def _overloaded() -> RequestError:
    return RequestError("the model is overloaded", code="overloaded", status_code=429,
                        error_type="overloaded")


async def test_a_full_engine_hands_the_request_on_without_counting_a_failure() -> None:
    full, other = FakeBackend("full", fail_open=_overloaded()), FakeBackend("other")
    router = _router(full, other)
    events = await _run(router)
    assert events[-1].text == "other" and full.calls == 1
    assert router.deployments[0].consecutive_failures == 0
    alone = _router(FakeBackend("full", fail_open=_overloaded()))
    with pytest.raises(RequestError) as caught:  # nowhere else to go: the client gets the 429
        await _run(alone)
    assert caught.value.status_code == 429


async def test_a_queue_timeout_hands_the_request_on_without_counting_a_failure() -> None:
    timed_out = RequestError("waited too long (--queue-timeout)", code="queue_timeout",
                             status_code=503, retry_after=2.0)
    slow, other = FakeBackend("slow", fail_open=timed_out), FakeBackend("other")
    router = _router(slow, other)
    events = await _run(router)
    assert events[-1].text == "other" and slow.calls == 1
    assert router.deployments[0].consecutive_failures == 0
    assert _outcomes(router, "slow") == {"fallback": 1}
    alone = _router(FakeBackend("slow", fail_open=timed_out))
    with pytest.raises(RequestError) as caught:  # nowhere else to go: the client gets the 503
        await _run(alone)
    assert (caught.value.status_code, caught.value.retry_after) == (503, 2.0)


async def test_cooldown_then_no_healthy_deployment_with_retry_after() -> None:
    clock = Clock()
    only = FakeBackend("only", fail_open=DeploymentError("down"))
    router = _router(only, clock=clock)
    for _ in range(2):
        with pytest.raises(DeploymentError, match="down"):
            await _run(router)
    assert router.deployments[0].state is DeploymentState.COOLING_DOWN
    clock.now += 12.5
    with pytest.raises(NoHealthyDeployment) as caught:
        await _run(router)
    assert (caught.value.status_code, caught.value.code) == (503, "no_healthy_deployment")
    assert caught.value.retry_after == 18  # ceil(30 - 12.5)
    assert only.calls == 2  # not tried while cooling down
    assert router.deployments[0].stats.cooldowns == 1


async def test_a_success_resets_the_failure_count() -> None:
    flaky = FakeBackend("flaky", fail_open=DeploymentError("blip"))
    router = _router(flaky)
    with pytest.raises(DeploymentError):
        await _run(router)
    flaky.fail_open = None
    await _run(router)
    flaky.fail_open = DeploymentError("blip")
    with pytest.raises(DeploymentError):
        await _run(router)
    assert router.deployments[0].in_rotation  # 1 failure since the success, not 2


async def test_in_flight_until_the_iterator_closes() -> None:
    gate = asyncio.Event()
    slow = FakeBackend("slow", tokens=5, gate=gate)
    router = _router(slow)
    events = router.generate(GenerationRequest(request_id="r", prompt="x"))
    assert router.deployments[0].in_flight == 0  # nothing happens before the first pull
    await anext(events)
    assert router.deployments[0].in_flight == 1
    await events.aclose()  # the client went away
    assert router.deployments[0].in_flight == 0 and slow.closed_early == 1
    assert sum(router.deployments[0].stats.outcomes.values()) == 0  # neither success nor failure


async def test_concurrent_requests_spread_and_count() -> None:
    gate = asyncio.Event()
    a, b = FakeBackend("a", gate=gate), FakeBackend("b", gate=gate)
    router = _router(a, b)
    streams = [router.generate(GenerationRequest(request_id=f"r{i}", prompt="x"))
               for i in range(4)]
    for s in streams:
        await anext(s)
    assert [d.in_flight for d in router.deployments] == [2, 2]
    gate.set()
    for s in streams:
        assert [e.finish_reason async for e in s][-1] == "length"
    assert [d.in_flight for d in router.deployments] == [0, 0]


def test_count_tokens_info_and_stats_come_from_the_best_in_rotation() -> None:
    main, spare = FakeBackend("main"), FakeBackend("spare")
    router = _router(spare, main, priorities=(1, 0))
    req = GenerationRequest(request_id="count", prompt="x")
    assert router.count_tokens(req) == 5 and main.counted == ["count"]
    router.deployments[1].state = DeploymentState.COOLING_DOWN
    assert router.info().name == "spare"
    router.deployments[0].state = DeploymentState.UNHEALTHY
    assert router.info().name == "main"  # none in rotation: the best priority
    assert router.stats().running == 2 and router.stats().kv_blocks_total == 20


def test_stats_sum_deployments_and_their_experts_expert_by_expert() -> None:
    summed = summed_stats([BackendStats(running=1, expert_tokens=(4, 1)),
                           BackendStats(running=2, expert_tokens=(1, 2, 3)), BackendStats()])
    assert summed == BackendStats(running=3, expert_tokens=(5, 3, 3))


def test_duplicate_deployment_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        _router(FakeBackend("x"), FakeBackend("x"))


def test_tokenize_needs_a_backend_that_can() -> None:
    class NoTokenizer(FakeBackend):
        tokenize = None  # type: ignore[assignment]

    req = GenerationRequest(request_id="t", prompt="x")
    assert _router(FakeBackend("a")).tokenize(req) == [1, 2, 3]
    with pytest.raises(RequestError) as caught:
        _router(NoTokenizer("b")).tokenize(req)
    assert "cannot tokenize" in caught.value.message and "/tokenize" in caught.value.message


def _n_request(n: int, rid: str = "n") -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt="x", sampling=SamplingParams(n=n))


async def test_n_choices_pass_through_until_every_choice_finished() -> None:
    router = _router(FakeBackend("multi", tokens=3))
    events = [e async for e in router.generate(_n_request(3))]
    finishes = [(e.index, e.finish_reason) for e in events if e.finish_reason]
    assert finishes == [(0, "length"), (1, "length"), (2, "length")]  # not cut at the first
    for choice in range(3):
        mine = [e for e in events if e.index == choice]
        assert len(mine) == 3 and mine[-1].usage is not None
    assert _outcomes(router, "multi") == {"success": 1}
    assert router.deployments[0].in_flight == 0


async def test_one_choice_ending_in_error_fails_the_deployment() -> None:
    router = _router(FakeBackend("half", tokens=2, error_choice=1))
    events = [e async for e in router.generate(_n_request(2))]
    assert [e.finish_reason for e in events if e.finish_reason] == ["length", "error"]
    assert _outcomes(router, "half") == {"failure": 1}


async def test_a_client_leaving_before_every_choice_finished_counts_nothing() -> None:
    router = _router(FakeBackend("multi", tokens=2))
    stream = router.generate(_n_request(2))
    seen = []
    async for event in stream:
        seen.append(event)
        if event.finish_reason is not None:  # choice 0 finished; choice 1 not yet
            break
    await stream.aclose()
    assert seen[-1].index == 0 and router.deployments[0].in_flight == 0
    assert sum(router.deployments[0].stats.outcomes.values()) == 0


def test_detokenize_goes_to_the_best_deployment_and_needs_one_that_can() -> None:
    class NoDetokenizer(FakeBackend):
        detokenize = None  # type: ignore[assignment]

    assert _router(FakeBackend("a")).detokenize([3, 4]) == "<3><4>"
    with pytest.raises(RequestError, match="vocabulary"):
        _router(FakeBackend("a")).detokenize([-1])
    with pytest.raises(RequestError) as caught:
        _router(NoDetokenizer("b")).detokenize([1])
    assert caught.value.status_code == 400
