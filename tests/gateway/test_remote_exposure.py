"""What a gateway in front of remote upstreams tells its clients, and what they can make it do.

A real uvicorn gateway, its models file naming a scripted OpenAI-compatible upstream on a
real port (tests/backends/openai_stub.py), driven by httpx and the openai SDK: /health and
/info never show (or reach) the upstream; its odd answers (Retry-After: inf, endless lines,
negative usage) come back as proper errors; requests that only fail for themselves (too
large for the upstream to start in time, a 4xx) never take the deployment out for everyone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.auth.conftest import ADMIN_KEY, admin_headers, create_key
from tests.backends.openai_stub import LONG_PROMPT, PIECES, OpenAIStub, create_openai_stub
from tests.gateway.conftest import running_server

ROUTING = "routing: {cooldown_after_failures: 2, cooldown_seconds: 60, " \
          "health_check_interval: 60}\n"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, OpenAIStub]]:
    stub = OpenAIStub()
    with running_server(create_openai_stub(stub)) as url:
        yield url, stub


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory,
            upstream: tuple[str, OpenAIStub]) -> Iterator[str]:
    """Three models on the one upstream: `m`, `slow` with a 0.5 s read timeout, and
    `limited` (which the rate-limit test cools down)."""
    url = upstream[0]
    config = tmp_path_factory.mktemp("exposure") / "models.yaml"
    config.write_text(
        ROUTING + "models:\n"
        f"  - {{name: m, deployments: [{{backend: remote, name: up, base_url: '{url}/v1', "
        "model: stub-model}]}\n"
        f"  - {{name: slow, deployments: [{{backend: remote, name: up, base_url: '{url}/v1', "
        "model: stub-model, read_timeout: 0.5}]}\n"
        f"  - {{name: limited, deployments: [{{backend: remote, name: up, "
        f"base_url: '{url}/v1', model: stub-model}}]}}\n")
    app = create_app(Settings(config_file=config, admin_key=ADMIN_KEY, metrics_auth="open"))
    with running_server(app, timeout_s=30) as served:
        yield served


@pytest.fixture
def stub(upstream: tuple[str, OpenAIStub]) -> OpenAIStub:
    upstream[1].mode, upstream[1].delay_s = "ok", 0.0
    return upstream[1]


def _sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def _states(url: str) -> dict[str, str]:
    report = httpx.get(f"{url}/health", headers=admin_headers()).json()["models"]
    return {model: r["deployments"]["up"]["state"] for model, r in report.items()}


def test_health_polls_never_reach_the_upstream_and_show_no_detail_without_the_admin_key(
    gateway: str, upstream: tuple[str, OpenAIStub], stub: OpenAIStub,
) -> None:
    deadline = time.monotonic() + 10
    while stub.gets < 3:  # each deployment was checked when it started
        assert time.monotonic() < deadline, "the upstream was never checked"
        time.sleep(0.05)
    asked = stub.gets
    with httpx.Client(base_url=gateway, timeout=10) as http:
        for _ in range(30):
            anonymous = http.get("/health")
            assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok"}
        wrong = http.get("/health", headers={"Authorization": "Bearer sy-not-the-admin"})
        assert wrong.json() == {"status": "ok"}
        admin = http.get("/health", headers=admin_headers())
    assert stub.gets == asked  # answered from what the background checker last heard
    report = admin.json()["models"]["m"]["deployments"]["up"]
    assert (report["ready"], report["state"]) == (True, "healthy")
    host = upstream[0].removeprefix("http://")
    for body in (anonymous.text, admin.text):
        assert host not in body and "http" not in body


def test_info_never_shows_the_upstream_address(
    gateway: str, upstream: tuple[str, OpenAIStub],
) -> None:
    info = httpx.get(f"{gateway}/info", headers={"x-model": "m"})
    assert info.status_code == 200
    assert "base_url" not in info.json()
    assert upstream[0].removeprefix("http://") not in info.text
    assert info.json()["upstream_model"] == "stub-model"


def test_credentials_in_a_base_url_are_refused_at_startup(tmp_path: Path) -> None:
    config = tmp_path / "models.yaml"
    config.write_text("models:\n  - {name: m, deployments: [{backend: remote, "
                      "base_url: 'https://bob:hunter2@llm.example/v1'}]}\n")
    with pytest.raises(ValueError, match="api_key_env") as caught:
        create_app(Settings(config_file=config))
    assert "base_url" in str(caught.value) and "hunter2" not in str(caught.value)


@pytest.mark.parametrize("value", ["inf", "nan", "1e999", "-inf"])
def test_an_unreadable_retry_after_from_the_upstream_is_a_429_or_503(
    gateway: str, stub: OpenAIStub, value: str,
) -> None:
    """A 429 passed on, or once two of them cooled the deployment down, a 503; never a 500,
    and always a Retry-After a client can use."""
    stub.mode = f"retry_after:{value}"
    answer = httpx.post(f"{gateway}/v1/chat/completions", headers=admin_headers(),
                        json={"model": "limited", "messages": CHAT}, timeout=30)
    assert answer.status_code in (429, 503), answer.text
    assert answer.json()["error"]["code"] in ("upstream_rate_limited", "no_healthy_deployment")
    assert 1 <= int(answer.headers["retry-after"]) <= 3600


def test_an_endless_line_from_the_upstream_is_a_502_naming_the_limit(
    gateway: str, stub: OpenAIStub,
) -> None:
    stub.mode = "endless_line"
    answer = httpx.post(f"{gateway}/v1/chat/completions", headers=admin_headers(),
                        json={"model": "m", "messages": CHAT}, timeout=60)
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["code"] == "upstream_too_large" and "too large" in error["message"]


def test_negative_usage_from_the_upstream_never_credits_a_key(
    gateway: str, stub: OpenAIStub,
) -> None:
    key = create_key(gateway, name="negative", budget=100_000)
    stub.mode = "negative_usage"
    answer = _sdk(gateway, key["key"]).chat.completions.create(model="m", messages=CHAT,
                                                               max_tokens=8)
    assert answer.choices[0].message.content == "".join(PIECES)
    assert answer.usage.prompt_tokens >= 0 and answer.usage.completion_tokens >= 0
    usage = httpx.get(f"{gateway}/v1/usage", headers={"Authorization": f"Bearer {key['key']}"})
    budget = usage.json()["budget"]
    assert budget["used"] >= 0 and budget["remaining"] <= 100_000
    (row,) = usage.json()["data"]
    assert row["prompt_tokens"] >= 0 and row["completion_tokens"] >= 0


def test_requests_failing_for_themselves_never_cool_the_deployment_down(
    gateway: str, stub: OpenAIStub,
) -> None:
    """Prompts too large for the upstream to start on within read_timeout, and 4xx answers:
    each fails alone, and the deployment stays in rotation for everyone else."""
    client = _sdk(gateway, create_key(gateway, name="oversized")["key"])
    stub.mode = "slow_long_prompts"
    large = [{"role": "user", "content": "word " * LONG_PROMPT}]
    for _ in range(3):
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model="slow", messages=large, max_tokens=4)
        assert caught.value.status_code == 504
        assert caught.value.body["code"] == "upstream_timeout"
    stub.mode = "status:400"
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="slow", messages=CHAT, max_tokens=4)
    stub.mode = "slow_long_prompts"
    short = client.chat.completions.create(model="slow", messages=CHAT, max_tokens=4)
    assert short.choices[0].message.content == "".join(PIECES)
    assert _states(gateway)["slow"] == "healthy"
