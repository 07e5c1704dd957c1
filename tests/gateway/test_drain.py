"""Graceful drain (gateway/drain.py) of a real gateway process, with API keys in a real
Redis: SIGTERM lets live streams finish and settle their usage, refuses new work with 503
meanwhile (`/health` too), and exits 0; a second signal exits at once; --shutdown-timeout
cuts what is left, still settling it."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tests.auth.conftest import ADMIN_KEY, RedisServer, admin_headers, create_key
from tests.gateway.drain_server import GatewayProcess

HI = [{"role": "user", "content": "hello there"}]
STREAMS, TOKENS = 8, 30  # the slow echo says 10 tokens a second: 3 s a stream


@pytest.fixture
def start(tmp_path: Path, redis_server: RedisServer) -> Iterator:
    started: list[GatewayProcess] = []

    def run(shutdown_timeout: float = 20) -> GatewayProcess:
        env = {"SWITCHYARD_REDIS_URL": redis_server.url, "SWITCHYARD_ADMIN_KEY": ADMIN_KEY,
               "SWITCHYARD_SHUTDOWN_TIMEOUT": str(shutdown_timeout)}
        started.append(GatewayProcess.start(tmp_path, env))
        return started[-1]

    yield run
    for process in started:
        process.stop()


def _usage(redis_server: RedisServer, key_id: str) -> dict[str, str]:
    with redis.Redis(port=redis_server.port, decode_responses=True) as client:
        return client.hgetall(f"sy:{{{key_id}}}:usage")


def _open_stream(client: openai.OpenAI, tokens: int) -> openai.Stream:
    return client.chat.completions.create(
        model="slow", messages=HI, max_tokens=tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})


def _wait_draining(url: str) -> None:
    deadline = time.monotonic() + 5
    while httpx.get(f"{url}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "/health never said 503"
        time.sleep(0.02)


def test_sigterm_lets_live_streams_finish_then_exits_0(
        start, redis_server: RedisServer) -> None:
    gateway = start()
    key = create_key(gateway.url, name="drain", parallel=STREAMS)
    auth = {"Authorization": f"Bearer {key['key']}"}
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key["key"], max_retries=0,
                           timeout=30)
    with httpx.Client(base_url=gateway.url, headers=auth, timeout=10) as kept:
        assert kept.get("/v1/models").status_code == 200  # a kept-alive connection
        streams = [_open_stream(client, TOKENS) for _ in range(STREAMS)]  # each one started
        signalled = time.monotonic()
        gateway.signal(signal.SIGTERM)
        _wait_draining(gateway.url)
        health = httpx.get(f"{gateway.url}/health", timeout=5)
        assert health.json()["status"] == "draining"
        refused = kept.get("/v1/models")  # on the connection opened before the signal
        assert refused.status_code == 503 and refused.headers["connection"] == "close"
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert refused.headers["x-switchyard-unprocessed"] == "1"  # a proxy may retry it
    with pytest.raises(openai.InternalServerError) as caught:  # a new connection
        client.chat.completions.create(model="slow", messages=HI, max_tokens=1)
    assert caught.value.status_code == 503 and caught.value.code == "server_shutting_down"
    assert "shutting down" in caught.value.message
    tgi = httpx.post(f"{gateway.url}/generate", json={"inputs": "hi"}, headers=auth, timeout=5)
    assert tgi.status_code == 503 and tgi.json()["error_type"] == "unavailable"
    assert tgi.headers["x-switchyard-unprocessed"] == "1"

    for stream in streams:
        chunks = list(stream)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == TOKENS
    assert gateway.proc.wait(20) == 0
    assert time.monotonic() - signalled < 15, gateway.logs()[-2000:]
    usage = _usage(redis_server, key["id"])
    assert usage["requests:slow"] == str(STREAMS), usage
    assert usage["completion_tokens:slow"] == str(STREAMS * TOKENS), usage
    assert "drained: shutting down" in gateway.logs()


def test_a_second_signal_exits_at_once(start) -> None:
    gateway = start()
    key = create_key(gateway.url, name="impatient")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key["key"], max_retries=0,
                           timeout=30)
    stream = _open_stream(client, 300)  # 30 s
    gateway.signal(signal.SIGTERM)
    _wait_draining(gateway.url)
    signalled = time.monotonic()
    gateway.signal(signal.SIGINT)
    assert gateway.proc.wait(5) == 128 + signal.SIGINT
    assert time.monotonic() - signalled < 2
    with pytest.raises((httpx.HTTPError, openai.APIError)):
        list(stream)


def test_the_shutdown_timeout_cuts_streams_and_still_settles_them(
        start, redis_server: RedisServer) -> None:
    gateway = start(shutdown_timeout=1)
    key = create_key(gateway.url, name="cut")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key["key"], max_retries=0,
                           timeout=30)
    stream = _open_stream(client, 300)
    signalled = time.monotonic()
    gateway.signal(signal.SIGTERM)
    assert gateway.proc.wait(10) == 0
    assert time.monotonic() - signalled < 8
    with pytest.raises((httpx.HTTPError, openai.APIError)):
        list(stream)
    usage = _usage(redis_server, key["id"])
    assert usage["requests:slow"] == "1"
    assert 0 < int(usage["completion_tokens:slow"]) < 300, usage
    assert "cancelling 1 request(s)" in gateway.logs()


def test_admin_key_still_lists_keys_before_the_signal(start) -> None:
    gateway = start()
    listed = httpx.get(f"{gateway.url}/admin/keys", headers=admin_headers(), timeout=5)
    assert listed.status_code == 200
    gateway.signal(signal.SIGTERM)
    assert gateway.proc.wait(10) == 0  # nothing in flight: it drains at once
