"""A request that runs longer than the lease TTL keeps its parallel-request slot: the gateway
renews the lease while the request runs (every third of the TTL), so a long generation still
counts against `parallel`; once it ends the slot is free at once. Real server, real Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from gateway.app import create_app
from gateway.settings import Settings
from tests.auth.conftest import ADMIN_KEY, RedisServer, create_key
from tests.auth.test_replicas import wait_until
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend

TTL_S = 2.0
SLOW = "slow"


@pytest.fixture(scope="module")
def url(redis_server: RedisServer) -> Iterator[str]:
    slow = EchoBackend(name=SLOW, max_total_tokens=100_000, delay_s=0.1)
    settings = Settings(model_id="unused", redis_url=redis_server.url, admin_key=ADMIN_KEY,
                        auth_lease_ttl=TTL_S)
    with running_server(create_app(settings, backends={SLOW: slow})) as base:
        yield base


def chat(url: str, key: str, **body: object) -> httpx.Response:
    payload = {"model": SLOW, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
               **body}
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=30,
                      headers={"Authorization": f"Bearer {key}"})


def test_a_long_request_keeps_its_slot_past_the_lease_ttl(
    url: str, redis_server: RedisServer,
) -> None:
    made = create_key(url, name="renewed", parallel=1, budget=100_000)
    body = {"model": SLOW, "messages": [{"role": "user", "content": "hold"}],
            "max_tokens": 200, "stream": True, "ignore_eos": True}  # 20 s of tokens
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {made['key']}"}) as held:
        assert held.status_code == 200
        time.sleep(3 * TTL_S + 0.5)  # three lease lifetimes
        refused = chat(url, made["key"])
        assert refused.status_code == 429, refused.text
        assert "parallel" in refused.json()["error"]["message"]
        with redis.Redis(port=redis_server.port) as client:  # its hold on the budget too
            assert client.zcard(f"sy:{{{made['id']}}}:held") == 1
    # The stream was dropped: settlement frees the slot (and renewal stops).
    wait_until(lambda: chat(url, made["key"]).status_code == 200, timeout_s=10)
