"""Error events inside an upstream's stream, through a router, over real HTTP: one that says
the request was at fault (a 4xx-class error object, TGI's `validation`) is the client's error
and never counts towards the deployment's cooldown, before the first token or after it; one
that says the upstream failed (5xx-class, TGI's `generation`), or a stream that breaks, does.
Otherwise any client could take every deployment of a model out of rotation by sending
prompts its upstreams refuse mid-stream."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from backends.base import Backend, DeploymentError, RequestError
from backends.registry import BackendSpec, create_backend
from routing import Deployment, DeploymentState, ModelRouter, RoutingPolicy
from tests.backends.harness import request
from tests.backends.openai_stub import OpenAIStub, create_openai_stub
from tests.backends.tgi_stub import StubTGI, create_stub_app
from tests.gateway.conftest import running_server

POLICY = RoutingPolicy(cooldown_after_failures=2, cooldown_seconds=30, health_check_interval=60)
Stub = OpenAIStub | StubTGI

# What upstreams send when the request is at fault ...
CLIENT_FRAMES: dict[str, tuple[str, dict[str, Any], int]] = {
    "openai": ("remote", {"error": {
        "message": "This model's maximum context length is 2048 tokens.",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}},
        400),
    "vllm": ("remote", {"error": {"message": "max_tokens must be at least 1, got 0.",
                                  "type": "BadRequestError", "param": None, "code": 400}}, 400),
    "tgi": ("tgi", {"error": "Input validation error: `inputs` tokens + `max_new_tokens` must "
                             "be <= 64. Given: 70", "error_type": "validation"}, 422),
}
# ... and when it failed itself.
SERVER_FRAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "openai": ("remote", {"error": {"message": "The server had an error",
                                    "type": "server_error", "param": None, "code": None}}),
    "vllm": ("remote", {"error": {"message": "EngineCore died", "type": "InternalServerError",
                                  "param": None, "code": 500}}),
    "switchyard": ("remote", {"error": {"message": "The model failed while generating.",
                                        "type": "api_error", "param": None,
                                        "code": "generation_error"}}),
    "no_type": ("remote", {"error": {"message": "something broke"}}),
    "tgi": ("tgi", {"error": "CUDA out of memory", "error_type": "generation"}),
    "tgi_unknown": ("tgi", {"error": "who knows"}),
}


@pytest.fixture(scope="module")
def upstreams() -> Iterator[dict[str, tuple[str, Stub]]]:
    openai, tgi = OpenAIStub(), StubTGI()
    with running_server(create_openai_stub(openai)) as openai_url, \
            running_server(create_stub_app(tgi)) as tgi_url:
        yield {"remote": (openai_url + "/v1", openai), "tgi": (tgi_url, tgi)}


async def _router(upstreams: dict[str, tuple[str, Stub]], kind: str,
                  ) -> tuple[ModelRouter, Stub]:
    url, stub = upstreams[kind]
    stub.mode, stub.error_at = "ok", 2
    stub.requests.clear()
    deployments = []
    for name in ("first", "second"):
        backend: Backend = create_backend(BackendSpec(
            name=name, model_id="unused", backend=kind,
            options={"base_url": url, "model": "stub-model"} if kind == "remote"
            else {"base_url": url}))
        await backend.start()
        deployments.append(Deployment(name, backend, priority=0 if name == "first" else 1))
    return ModelRouter("m", deployments, POLICY), stub


async def _failing(router: ModelRouter, stub: Stub, expected: type[Exception],
                   ) -> tuple[list[str], Exception]:
    """One request through the router: the text it streamed and the error it ended with."""
    texts: list[str] = []
    with pytest.raises(expected) as caught:
        async for event in router.generate(request("a b c", max_tokens=10)):
            texts.append(event.text)
    return texts, caught.value


@pytest.mark.parametrize("error_at", [2, 0], ids=["mid_stream", "first_event"])
@pytest.mark.parametrize("upstream", list(CLIENT_FRAMES))
async def test_an_error_event_blaming_the_request_never_cools_the_deployment_down(
    upstreams, upstream: str, error_at: int,
) -> None:
    kind, frame, status = CLIENT_FRAMES[upstream]
    router, stub = await _router(upstreams, kind)
    stub.mode, stub.error_frame, stub.error_at = "error_event", frame, error_at
    try:
        for _ in range(POLICY.cooldown_after_failures + 2):
            texts, error = await _failing(router, stub, RequestError)
            assert isinstance(error, RequestError) and error.status_code == status
            assert len(texts) == error_at  # the tokens before the error reached the client
    finally:
        await router.close()
    first, second = router.deployments
    assert first.state is DeploymentState.HEALTHY and first.consecutive_failures == 0
    assert first.stats.outcomes["client_error"] == POLICY.cooldown_after_failures + 2
    assert second.stats.outcomes["fallback"] == second.stats.outcomes["success"] == 0
    assert len(stub.requests) == POLICY.cooldown_after_failures + 2  # never sent elsewhere


@pytest.mark.parametrize("upstream", [*SERVER_FRAMES, "die_remote", "die_tgi"])
async def test_an_upstream_failing_mid_stream_cools_the_deployment_down(
    upstreams, upstream: str,
) -> None:
    kind = upstream.removeprefix("die_") if upstream.startswith("die_") else \
        SERVER_FRAMES[upstream][0]
    router, stub = await _router(upstreams, kind)
    if upstream.startswith("die_"):
        stub.mode = "die"  # the connection breaks
    else:
        stub.mode, stub.error_frame = "error_event", SERVER_FRAMES[upstream][1]
    try:
        for _ in range(POLICY.cooldown_after_failures):
            texts, error = await _failing(router, stub, DeploymentError)
            assert len(texts) == 2 and isinstance(error, DeploymentError)
            assert error.status_code == 502
    finally:
        await router.close()
    assert router.deployments[0].state is DeploymentState.COOLING_DOWN
