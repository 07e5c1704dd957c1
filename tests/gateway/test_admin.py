"""/v1/models, /health, /metrics and the lifespan."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["echo", "slow"]
    for m in models.data:
        assert (m.object, m.owned_by) == ("model", "switchyard")
        assert isinstance(m.created, int)
    assert client.models.retrieve("slow").id == "slow"


def test_models_raw_shape(http: httpx.Client) -> None:
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert set(body["data"][0]) == {"id", "object", "created", "owned_by", "sampling_defaults",
                                    "task"}
    assert body["data"][0]["task"] == "generate"
    assert body["data"][0]["sampling_defaults"] == {}  # an echo model has no defaults


def test_health_ready(http: httpx.Client) -> None:
    response = http.get("/health")
    assert response.status_code == 200
    assert response.json()["models"]["echo"]["ready"] is True


def test_health_503_while_not_ready(serve_app) -> None:
    loading = EchoBackend(name="loading", ready=False)
    url = serve_app(create_app(Settings(), backends={"ok": EchoBackend(), "loading": loading}))
    response = httpx.get(f"{url}/health")
    assert response.status_code == 503
    report = response.json()["models"]["loading"]
    assert (report["ready"], report["detail"]) == (False, "loading")
    deployment = report["deployments"]["loading"]
    assert (deployment["ready"], deployment["detail"], deployment["in_flight"]) == (
        False, "loading", 0)
    assert deployment["state"] in ("healthy", "unhealthy")  # once the health checker saw it
    loading.ready = True
    assert httpx.get(f"{url}/health").status_code == 200


def test_metrics(client: openai.OpenAI, http: httpx.Client) -> None:
    client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "a b"}],
                                   max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="ghost", messages=[{"role": "user", "content": "a"}])
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert 'switchyard_requests_total{model="echo",route="/v1/chat/completions",status="200"}' \
        in text
    assert 'switchyard_requests_total{model="",route="/v1/chat/completions",status="404"}' in text
    assert 'switchyard_request_duration_seconds_bucket{' in text
    assert 'switchyard_prompt_tokens_total{model="echo"}' in text
    assert 'switchyard_generated_tokens_total{model="echo"}' in text
    assert 'switchyard_time_to_first_token_seconds_count{model="echo"}' in text
    assert 'switchyard_kv_blocks_used{model="echo"} 3.0' in text
    assert 'switchyard_kv_blocks_total{model="echo"} 10.0' in text
    assert 'switchyard_queue_size{model="slow"} 0.0' in text
    assert 'switchyard_running_requests{model="echo"}' in text


def test_apps_have_separate_registries() -> None:
    one = create_app(Settings(), backends={"a": EchoBackend()})
    two = create_app(Settings(), backends={"a": EchoBackend()})
    assert one.state.gateway.metrics.registry is not two.state.gateway.metrics.registry


def test_lifespan_starts_and_closes_backends() -> None:
    backend = EchoBackend()
    with running_server(create_app(Settings(), backends={"echo": backend})) as url:
        assert backend.started and not backend.closed
        assert httpx.get(f"{url}/health").status_code == 200
    assert backend.closed


class _BrokenBackend(EchoBackend):
    async def start(self) -> None:
        raise RuntimeError("weights not found")


def test_failed_start_closes_started_backends_and_refuses_to_serve() -> None:
    first = EchoBackend()
    app = create_app(Settings(), backends={"first": first, "broken": _BrokenBackend()})
    with pytest.raises(RuntimeError, match="did not start"), running_server(app):
        pass
    assert first.started and first.closed


def test_open_mode_is_logged_loudly(caplog: pytest.LogCaptureFixture) -> None:
    with running_server(create_app(Settings(), backends={"echo": EchoBackend()})):
        pass
    assert any("OPEN MODE" in r.message and r.levelname == "WARNING" for r in caplog.records)
