"""A gateway killed outright (SIGKILL) while it holds a parallel-request slot or a budget
reservation leaks nothing in Redis: the slot and the reservation stay held until their lease's
deadline (--auth-lease-ttl; a live gateway renews it), then free themselves for every replica,
and no usage is invented for the request that died with it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import redis

from tests.auth.conftest import ADMIN_KEY, RedisServer, create_key
from tests.gateway.drain_server import GatewayProcess

TTL_S = 2
HI = [{"role": "user", "content": "hello there"}]


def _sdk(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30)


def _redis_now_ms(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds * 1000 + micros / 1000


@contextmanager
def _victim_and_survivor(redis_server: RedisServer,
                         tmp_path: Path) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """Two gateways on one Redis with a short lease TTL, stopped after."""
    env = {"SWITCHYARD_REDIS_URL": redis_server.url, "SWITCHYARD_ADMIN_KEY": ADMIN_KEY,
           "SWITCHYARD_AUTH_LEASE_TTL": str(TTL_S)}
    spawned = [GatewayProcess.spawn(tmp_path, env, name) for name in ("victim", "survivor")]
    try:
        victim, survivor = (g.ready(tmp_path / f"{n}.port")
                            for g, n in zip(spawned, ("victim", "survivor"), strict=True))
        yield victim, survivor
    finally:
        for gateway in spawned:
            gateway.stop()


def _stream_started(gateway: GatewayProcess, key: str) -> openai.Stream:
    """A 300-token stream on `gateway`, its first chunk read (the request is running). Keep
    it referenced: a collected stream closes its connection and so ends the request."""
    stream = _sdk(gateway, key).chat.completions.create(
        model="slow", messages=HI, max_tokens=300, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    return stream


def test_a_killed_gateways_lease_expires_after_its_ttl(
        redis_server: RedisServer, tmp_path: Path) -> None:
    with _victim_and_survivor(redis_server, tmp_path) as (victim, survivor):
        key = create_key(victim.url, name="crash", parallel=1)
        inflight = f"sy:{{{key['id']}}}:inflight"
        stream = _stream_started(victim, key["key"])  # noqa: F841 (kept open)
        with redis.Redis(port=redis_server.port) as client:
            [(_, deadline_ms)] = client.zrange(inflight, 0, -1, withscores=True)
            victim.proc.kill()
            victim.proc.wait(10)
            assert client.zcard(inflight) == 1  # nobody released it
            with pytest.raises(openai.RateLimitError):
                _sdk(survivor, key["key"]).chat.completions.create(
                    model="slow", messages=HI, max_tokens=1)
            reply = _until_admitted(survivor, key["key"])
            assert _redis_now_ms(client) >= deadline_ms  # admitted only once the lease expired
            assert reply.choices[0].message.content
            assert client.exists(inflight) == 0  # the survivor's own lease was released
            usage = client.hgetall(f"sy:{{{key['id']}}}:usage")
        assert usage[b"requests:slow"] == b"1"  # the survivor's request alone


def _until_admitted(gateway: GatewayProcess, key: str, **body: object,
                    ) -> openai.types.chat.ChatCompletion:
    ask = body or {"model": "slow", "messages": HI, "max_tokens": 1}
    deadline = time.monotonic() + TTL_S + 5
    while True:
        try:
            return _sdk(gateway, key).chat.completions.create(**ask)  # type: ignore[call-overload]
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the lease never expired"
            time.sleep(0.1)


def test_a_killed_gateways_budget_reservation_is_given_back(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """The victim reserved 302 of a 400-token budget (prompt 2 + max_tokens 300) and died:
    the reservation lapses with its lease, and the survivor's 152 fit again."""
    with _victim_and_survivor(redis_server, tmp_path) as (victim, survivor):
        key = create_key(victim.url, name="crash-budget", budget=400)
        stream = _stream_started(victim, key["key"])  # noqa: F841 (kept open)
        victim.proc.kill()
        victim.proc.wait(10)
        ask = {"model": "slow", "messages": HI, "max_tokens": 150}
        with pytest.raises(openai.RateLimitError):  # 302 held + 152 > 400
            _sdk(survivor, key["key"]).chat.completions.create(**ask)
        reply = _until_admitted(survivor, key["key"], **ask)
        used = reply.usage.total_tokens
        with redis.Redis(port=redis_server.port, decode_responses=True) as client:
            budget = client.hget(f"sy:{{{key['id']}}}:budget", "used")
        assert int(budget) == used  # the survivor's request alone is charged
