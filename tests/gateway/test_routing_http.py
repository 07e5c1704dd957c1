"""Routing over HTTP: a real uvicorn server driven by the real openai SDK.

Two tiny native models (different random weights) from one models file, chosen by `model`,
by `x-model` and by an alias; then stand-in deployments for fallbacks, cooldowns, recovery
through the health checker, 503 + Retry-After, mid-stream failures and per-deployment
metrics.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from backends.base import (
    DeploymentError,
    GenerationEvent,
    GenerationRequest,
    SamplingParams,
)
from gateway.app import create_app
from gateway.settings import Settings
from routing import Deployment
from tests.auth.conftest import ADMIN_KEY, admin_headers, create_key
from tests.conftest import write_tiny_model
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend

PROMPT = "Once upon a time"
ENGINE = "{dtype: float32, max_total_tokens: 256, max_batch_total_tokens: 2048, " \
         "block_size: 8, compile: false}"


# -- two native models -------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> list[Path]:
    return [write_tiny_model(tmp_path_factory.mktemp(f"seed{seed}"), tokenizer_dir,
                             "llama_gqa", seed=seed) for seed in (1, 2)]


async def _alone(folder: Path) -> str:
    """Greedy text of one model served by nothing but its own engine."""
    from backends.native.backend import NativeBackend
    from backends.native.config import EngineConfig

    backend = NativeBackend(EngineConfig(
        model=str(folder), dtype="float32", max_total_tokens=256, max_batch_total_tokens=2048,
        block_size=8, compile=False))
    await backend.start()
    try:
        req = GenerationRequest("ref", SamplingParams(max_tokens=8, temperature=0), PROMPT)
        return "".join([e.text async for e in backend.generate(req)])
    finally:
        await backend.close()


@pytest.fixture(scope="module")
def references(model_dirs: list[Path]) -> list[str]:
    texts = [asyncio.run(_alone(folder)) for folder in model_dirs]
    assert texts[0] != texts[1], "the two random models should not agree"
    return texts


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory, model_dirs: list[Path]) -> Iterator[str]:
    config = tmp_path_factory.mktemp("config") / "models.yaml"
    config.write_text(
        "models:\n"
        f"  - name: first\n    model_id: {model_dirs[0]}\n    aliases: [gpt-4o, one]\n"
        f"    options: {ENGINE}\n"
        "  - name: second\n    aliases: [two]\n    deployments:\n"
        f"      - {{backend: native, name: local, model_id: {model_dirs[1]}, options: {ENGINE}}}\n")
    with running_server(create_app(Settings(config_file=config)), timeout_s=180) as url:
        yield url


def _complete(url: str, model: str, headers: dict[str, str] | None = None) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=60,
                           default_headers=headers)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    return out.choices[0].text


def test_each_model_answers_its_own_reference(two_models: str, references: list[str]) -> None:
    first, second = references
    assert _complete(two_models, "first") == first
    assert _complete(two_models, "second") == second
    assert _complete(two_models, "gpt-4o") == first  # an alias
    assert _complete(two_models, "two") == second
    assert _complete(two_models, "first", {"x-model": "second"}) == second  # the header wins
    assert _complete(two_models, "no-such-model", {"x-model": "one"}) == first
    streamed = openai.OpenAI(base_url=f"{two_models}/v1", api_key="k", max_retries=0).completions
    chunks = streamed.create(model="two", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == second
    tgi = httpx.post(f"{two_models}/generate", headers={"x-model": "one"}, timeout=60,
                     json={"inputs": PROMPT, "parameters": {"max_new_tokens": 8}})
    assert tgi.json()["generated_text"] == first


def test_models_lists_aliases(two_models: str) -> None:
    client = openai.OpenAI(base_url=f"{two_models}/v1", api_key="k", max_retries=0)
    cards = client.models.list().data
    assert [m.id for m in cards] == ["first", "gpt-4o", "one", "second", "two"]
    assert [getattr(m, "alias_of", None) for m in cards] == [
        None, "first", "first", None, "second"]
    assert all((m.object, m.owned_by) == ("model", "switchyard") for m in cards)
    assert client.models.retrieve("two").alias_of == "second"


def test_health_and_metrics_per_deployment(two_models: str) -> None:
    _complete(two_models, "second")
    health = httpx.get(f"{two_models}/health").json()
    assert health["status"] == "ok"
    assert health["models"]["second"]["deployments"]["local"]["state"] == "healthy"
    assert health["models"]["first"]["deployments"]["native-0"]["ready"] is True
    text = httpx.get(f"{two_models}/metrics").text
    labels = 'deployment="local",model="second"'
    assert _value(text, f'switchyard_deployment_requests_total{{{labels},outcome="success"}}') >= 1
    assert _value(text, f"switchyard_deployment_in_flight{{{labels}}}") == 0
    assert _value(text, f"switchyard_deployment_healthy{{{labels}}}") == 1
    assert _value(text, f"switchyard_deployment_latency_seconds_count{{{labels}}}") >= 1
    assert _value(text, f"switchyard_deployment_cooldowns_total{{{labels}}}") == 0


def _value(metrics: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", metrics, re.MULTILINE)
    assert match, f"{series} not exported"
    return float(match.group(1))


# -- stand-in deployments: fallbacks, cooldowns, recovery ----------------------------------

@dataclass
class Flaky(EchoBackend):
    """An echo deployment that fails like a remote one: before its first event (`fail_open`)
    or after two events (`fail_midway`)."""

    fail_open: bool = False
    fail_midway: bool = False

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self.requests.append(req)
        return self._flaky(req)

    async def _flaky(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        if self.fail_open:
            raise DeploymentError(f"{self.name}: connection refused")
        async with aclosing(self._generate(req)) as events:
            sent = 0
            async for event in events:
                yield event
                sent += 1
                if self.fail_midway and sent == 2:
                    raise DeploymentError(f"{self.name}: the upstream closed the stream")


CHAT = [{"role": "user", "content": "a b c"}]
# A cooldown of 1 s ran out on a loaded machine between the failure that began it and the
# request that must skip the cooled-down deployment.
FAST_ROUTING = "routing: {cooldown_after_failures: 2, cooldown_seconds: 3, " \
               "health_check_interval: 0.2}\n"


@pytest.fixture(scope="module")
def stand_ins() -> tuple[Flaky, Flaky]:
    return Flaky(name="primary", max_total_tokens=1000), Flaky(name="backup",
                                                               max_total_tokens=1000)


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory, stand_ins: tuple[Flaky, Flaky],
           ) -> Iterator[str]:
    primary, backup = stand_ins
    config = tmp_path_factory.mktemp("routed") / "models.yaml"
    config.write_text(FAST_ROUTING + "models:\n  - {name: m, model_id: unused, aliases: [mm]}\n")
    deployments = [Deployment("primary", primary, priority=0),
                   Deployment("backup", backup, priority=1)]
    app = create_app(Settings(config_file=config, admin_key=ADMIN_KEY), backends={"m": deployments})
    with running_server(app) as url:
        yield url


@pytest.fixture
def fresh(routed: str, stand_ins: tuple[Flaky, Flaky]) -> tuple[Flaky, Flaky]:
    """Both stand-ins behave and are back in rotation."""
    for flaky in stand_ins:
        flaky.fail_open = flaky.fail_midway = False
        flaky.ready = True
    _wait_for(lambda: set(_states(routed).values()) == {"healthy"})
    return stand_ins


def _states(url: str, model: str = "m") -> dict[str, str]:
    report = httpx.get(f"{url}/health", headers=admin_headers()).json()["models"][model][
        "deployments"]
    return {name: d["state"] for name, d in report.items()}


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10)


def test_fallback_cooldown_and_recovery(routed: str, fresh: tuple[Flaky, Flaky]) -> None:
    primary, backup = fresh
    client = _sdk(routed, create_key(routed, name="fallback")["key"])
    assert client.chat.completions.create(model="m", messages=CHAT).choices[0].message.content
    assert (len(primary.requests), len(backup.requests)) == (1, 0)  # priority 0 first
    primary.fail_open = True  # still answers its health checks
    whole = client.chat.completions.create(model="m", messages=CHAT, max_tokens=3)
    chunks = list(client.chat.completions.create(model="mm", messages=CHAT, max_tokens=3,
                                                 stream=True))
    assert whole.choices[0].message.content == "alpha beta gamma"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "alpha beta gamma"
    assert (len(primary.requests), len(backup.requests)) == (3, 2)
    # Two failures in a row: primary cools down and is not even tried.
    client.chat.completions.create(model="m", messages=CHAT, max_tokens=1)
    assert (len(primary.requests), len(backup.requests)) == (3, 3)
    report = httpx.get(f"{routed}/health", headers=admin_headers()).json()["models"]["m"]
    assert report["ready"] is True and report["deployments"]["primary"]["state"] == "cooling_down"
    metrics = httpx.get(f"{routed}/metrics", headers=admin_headers()).text
    primary_labels = 'deployment="primary",model="m"'
    assert _value(metrics, f'switchyard_deployment_requests_total{{{primary_labels},'
                           'outcome="fallback"}') == 2
    assert _value(metrics, f"switchyard_deployment_cooldowns_total{{{primary_labels}}}") == 1
    assert _value(metrics, f"switchyard_deployment_healthy{{{primary_labels}}}") == 0
    # The cooldown ends; the probe says not ready, so it stays out; then it recovers.
    primary.ready = False
    _wait_for(lambda: _states(routed)["primary"] == "unhealthy")
    primary.fail_open, primary.ready = False, True
    _wait_for(lambda: _states(routed)["primary"] == "healthy")
    client.chat.completions.create(model="m", messages=CHAT, max_tokens=1)
    assert len(primary.requests) == 4


def test_mid_stream_failure_is_not_retried_and_usage_is_recorded(
    routed: str, fresh: tuple[Flaky, Flaky],
) -> None:
    primary, backup = fresh
    key = create_key(routed, name="midway")
    client = _sdk(routed, key["key"])
    primary.fail_midway = True
    backup_before = len(backup.requests)
    got: list[str] = []
    with pytest.raises(openai.APIError, match="closed the stream"):
        for chunk in client.chat.completions.create(model="m", messages=CHAT, max_tokens=6,
                                                    stream=True):
            assert not (chunk.choices and chunk.choices[0].finish_reason)  # never a fake stop
            got.append((chunk.choices[0].delta.content or "") if chunk.choices else "")
    assert "".join(got) == "alpha beta"
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="m", messages=CHAT, max_tokens=6)
    assert caught.value.status_code == 502 and caught.value.code == "upstream_error"
    assert len(backup.requests) == backup_before  # never retried after the first event
    usage = httpx.get(f"{routed}/admin/keys/{key['id']}/usage", headers=admin_headers()).json()
    (row,) = usage["data"]
    assert (row["model"], row["requests"], row["completion_tokens"]) == ("m", 2, 4)


@pytest.fixture
def solo() -> Iterator[tuple[str, Flaky]]:
    only = Flaky(name="only", fail_open=True)
    with running_server(create_app(Settings(), backends={"solo": [Deployment("only", only)]})) \
            as url:
        yield url, only


def test_all_failed_then_all_cooling_down(solo: tuple[str, Flaky]) -> None:
    url, only = solo
    body = {"model": "solo", "messages": CHAT}
    for stream in (False, True, False):  # its only deployment failed: the last error
        answer = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream})
        assert answer.status_code == 502 and "connection refused" in answer.text
    for stream in (False, True):  # three failures in a row: cooling down for 30 s
        answer = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream})
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "no_healthy_deployment"
        assert 25 <= int(answer.headers["retry-after"]) <= 30
    assert len(only.requests) == 3
    assert httpx.get(f"{url}/health").status_code == 503
