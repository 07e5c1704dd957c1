"""Redis stops mid-test: clear 503s (or, when asked, failing open: only keys validated lately,
within their allow-lists); Redis returns: requests succeed again, without restarting the
gateway. The real engine serves the model (the echo stand-in where only auth matters)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.auth.conftest import ADMIN_KEY, RedisServer, admin_headers, create_key
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 2}


@contextmanager
def gateway(redis: RedisServer, tiny: Path, **settings: object) -> Iterator[str]:
    config = EngineConfig(model=str(tiny), served_model_name="tiny", dtype="float32",
                          max_total_tokens=128, max_batch_total_tokens=512, block_size=8,
                          compile=False)
    app = create_app(Settings(model_id="unused", redis_url=redis.url, admin_key=ADMIN_KEY,
                              **settings), backends={"tiny": NativeBackend(config)})
    with running_server(app, timeout_s=120) as url:
        yield url


def ask(url: str, key: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=30,
                      headers={"Authorization": f"Bearer {key}"})


def test_redis_down_answers_503_and_recovers_by_itself(
    own_redis: RedisServer, tiny_model: Callable[[str], Path],
) -> None:
    with gateway(own_redis, tiny_model("llama_gqa")) as url:
        made = create_key(url, name="outage", rpm=100, parallel=4)
        assert ask(url, made["key"]).status_code == 200

        own_redis.stop(save=True)  # a persistent Redis going away (its keys are on disk)
        for _ in range(2):
            down = ask(url, made["key"])
            assert down.status_code == 503
            error = down.json()["error"]
            assert error["code"] == "auth_store_unavailable"
            assert "Redis" in error["message"] and "unreachable" in error["message"]
            assert down.headers["retry-after"] == "1"
        listing = httpx.get(f"{url}/admin/keys", headers=admin_headers())
        assert listing.status_code == 503
        assert httpx.get(f"{url}/health").status_code == 200  # health does not need Redis

        own_redis.start()  # same port: the gateway's client reconnects on its own
        back = ask(url, made["key"])
        assert back.status_code == 200, back.text
        assert back.headers["x-ratelimit-remaining-requests"] == "98"
        assert ask(url, "sk-sy-wrong").status_code == 401


def test_fail_open_serves_without_checks_while_redis_is_down(
    own_redis: RedisServer, tiny_model: Callable[[str], Path], caplog: pytest.LogCaptureFixture,
) -> None:
    with gateway(own_redis, tiny_model("llama_gqa"), auth_fail_open=True) as url:
        made = create_key(url, name="fail-open", rpm=1)
        assert ask(url, made["key"]).status_code == 200
        assert ask(url, made["key"]).status_code == 429
        own_redis.stop()
        assert ask(url, made["key"]).status_code == 200  # no checks: the limit is not known
        assert any("--auth-fail-open" in r.getMessage() for r in caplog.records)
        own_redis.start()  # a Redis without persistence: the key is gone with it
        assert ask(url, made["key"]).status_code == 401


@contextmanager
def echo_gateway(redis: RedisServer, **settings: object) -> Iterator[str]:
    """Two models, `echo` and `other`, served by the echo stand-in."""
    app = create_app(Settings(model_id="unused", redis_url=redis.url, admin_key=ADMIN_KEY,
                              **settings),
                     backends={"echo": EchoBackend(name="echo"), "other": EchoBackend("other")})
    with running_server(app) as url:
        yield url


def ask_model(url: str, key: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=30,
                      json={**BODY, "model": model}, headers={"Authorization": f"Bearer {key}"})


def test_fail_open_serves_only_recently_validated_keys_within_their_models(
    own_redis: RedisServer,
) -> None:
    with echo_gateway(own_redis, auth_fail_open=True, auth_fail_open_ttl=4) as url:
        known = create_key(url, name="known", models=["echo"], rpm=100)["key"]
        never_used = create_key(url, name="never-used")["key"]
        assert ask_model(url, known, "echo").status_code == 200  # validated now
        own_redis.stop()
        assert ask_model(url, known, "echo").status_code == 200  # limits unchecked
        other = ask_model(url, known, "other")
        assert other.status_code == 403, other.text  # its allow-list still holds
        assert other.json()["error"]["code"] == "model_not_allowed"
        for stranger in (never_used, "sk-sy-" + secrets.token_urlsafe(32)):
            refused = ask_model(url, stranger, "echo")
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "auth_store_unavailable"
            assert "validated" in refused.json()["error"]["message"]
        time.sleep(4.5)  # past --auth-fail-open-ttl since the key was last validated
        assert ask_model(url, known, "echo").status_code == 503
