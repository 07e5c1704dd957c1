"""End to end: one model, two `remote` deployments, each an upstream Switchyard server.

The upstreams are real `switchyard serve` processes (native engine, the same tiny model) on
fixed ports, so one can be killed (SIGKILL) and restarted on its port. The gateway under
test runs in this process with API keys in memory and is driven by the openai SDK.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.auth.conftest import ADMIN_KEY, admin_headers, create_key
from tests.deploy.gateways import GatewayProcess, write_models_file
from tests.gateway.conftest import running_server

MODEL = "tiny"
Pair = tuple[GatewayProcess, GatewayProcess]
MESSAGES = [{"role": "user", "content": "Tell me about the two upstreams."}]
ROUTING = "routing: {cooldown_after_failures: 2, cooldown_seconds: 1.5, " \
          "health_check_interval: 30}\n"


def _upstream(name: str, model_dir: Path, folder: Path) -> GatewayProcess:
    """An open `switchyard serve` of the tiny model, killable and restartable on its port."""
    config_file = write_models_file(folder / f"{name}.yaml", {MODEL: model_dir})
    return GatewayProcess(name, folder, config_file)


@pytest.fixture(scope="module")
def upstreams(tmp_path_factory: pytest.TempPathFactory,
              tiny_model: Callable[[str], Path]) -> Iterator[Pair]:
    folder = tmp_path_factory.mktemp("upstreams")
    pair = (_upstream("a", tiny_model("llama_gqa"), folder),
            _upstream("b", tiny_model("llama_gqa"), folder))
    try:
        for upstream in pair:
            upstream.start()
        for upstream in pair:
            upstream.wait_ready()
        yield pair
    finally:
        for upstream in pair:
            upstream.kill()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, upstreams: Pair,
            tiny_model: Callable[[str], Path]) -> Iterator[str]:
    tokenizer = tiny_model("llama_gqa")
    deployments = "".join(
        f"      - {{backend: remote, name: {u.name}, base_url: '{u.url}/v1', model: {MODEL}, "
        f"tokenizer: '{tokenizer}', max_total_tokens: 512}}\n" for u in upstreams)
    config = tmp_path_factory.mktemp("gateway") / "models.yaml"
    config.write_text(ROUTING + f"models:\n  - name: {MODEL}\n    deployments:\n" + deployments)
    app = create_app(Settings(config_file=config, admin_key=ADMIN_KEY, metrics_auth="open"))
    with running_server(app, timeout_s=60) as url:
        yield url


def _sdk(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def _ask(client: openai.OpenAI, **extra: object) -> tuple[str, tuple[int, int]]:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                         temperature=0, **extra)
    return out.choices[0].message.content, (out.usage.prompt_tokens, out.usage.completion_tokens)


def _ask_streamed(client: openai.OpenAI) -> tuple[str, tuple[int, int]]:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, (usage.prompt_tokens, usage.completion_tokens)


def _states(url: str) -> dict[str, str]:
    report = httpx.get(f"{url}/health", headers=admin_headers(),
                       timeout=10).json()["models"][MODEL]["deployments"]
    return {name: d["state"] for name, d in report.items()}


def _metric(url: str, series: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _successes(url: str, deployment: str) -> float:
    return _metric(url, "switchyard_deployment_requests_total"
                        f'{{deployment="{deployment}",model="{MODEL}",outcome="success"}}')


def test_answers_equal_asking_an_upstream_directly(
    gateway: str, upstreams: Pair,
) -> None:
    key = create_key(gateway, name="equal")["key"]
    direct = _ask(_sdk(upstreams[0].url))
    for _ in range(2):  # round robin: both deployments answer
        assert _ask(_sdk(gateway, key)) == direct
        assert _ask_streamed(_sdk(gateway, key)) == direct
    assert _successes(gateway, "a") >= 1 and _successes(gateway, "b") >= 1


def test_kill_one_upstream_then_bring_it_back(
    gateway: str, upstreams: Pair,
) -> None:
    _, b = upstreams
    client = _sdk(gateway, create_key(gateway, name="failover")["key"])
    expected = _ask(_sdk(upstreams[0].url))
    b.kill()
    for _ in range(6):  # no client-visible error: b's failures fall back to a
        assert _ask(client) == expected
    assert _states(gateway)["b"] in ("cooling_down", "unhealthy")
    labels = f'deployment="b",model="{MODEL}"'
    assert _metric(gateway, f'switchyard_deployment_requests_total{{{labels},'
                            'outcome="fallback"}') >= 2
    assert _metric(gateway, f"switchyard_deployment_cooldowns_total{{{labels}}}") >= 1
    b_served = _successes(gateway, "b")
    b.start()  # on the same port
    b.wait_ready()
    _wait_for(lambda: _states(gateway)["b"] == "healthy")
    for _ in range(4):
        assert _ask(client) == expected
    assert _successes(gateway, "b") > b_served


def test_mid_stream_kill_ends_the_stream_with_an_error_and_records_usage(
    gateway: str, upstreams: Pair,
) -> None:
    key = create_key(gateway, name="midstream")
    _wait_for(lambda: set(_states(gateway).values()) == {"healthy"})
    stream = _sdk(gateway, key["key"]).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=480, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    received: list[str] = []
    with pytest.raises(openai.APIError):
        for chunk in stream:
            assert chunk.choices[0].finish_reason is None  # never a fake "stop"
            received.append(chunk.choices[0].text)
            if len(received) == 3:
                serving = [name for name, d in _deployments(gateway).items() if d["in_flight"]]
                assert len(serving) == 1
                next(u for u in upstreams if u.name == serving[0]).kill()
    assert 3 <= len(received) < 480
    usage = httpx.get(f"{gateway}/admin/keys/{key['id']}/usage", headers=admin_headers(),
                      timeout=10).json()
    (row,) = usage["data"]
    assert row["requests"] == 1 and row["completion_tokens"] >= len(received)


def _deployments(url: str) -> dict[str, dict]:
    return httpx.get(f"{url}/health", headers=admin_headers(),
                     timeout=10).json()["models"][MODEL]["deployments"]
