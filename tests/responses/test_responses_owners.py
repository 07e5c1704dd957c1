"""Where stored responses live and who may see them, on real servers: the SQLite store under
the cache directory outlives a restart; two gateways on one redis-server share theirs; a
response belongs to the key that made it (another key, the admin key or an open-mode caller
gets the 404 an unknown id gets)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.responses_api.redis_store import PREFIX
from gateway.settings import Settings
from tests.auth.conftest import ADMIN_KEY, RedisServer
from tests.responses.conftest import MODEL, Serve, new_key, sdk

TTL_S = 3600.0


def _create(client: openai.OpenAI, **extra: Any) -> Any:
    return client.responses.create(model=MODEL, temperature=0, max_output_tokens=3, **extra)


def _invisible_to(client: openai.OpenAI, response_id: str) -> None:
    """Every way to reach `response_id` is a 404 for `client`."""
    calls: list[Callable[[], Any]] = [
        lambda: client.responses.retrieve(response_id),
        lambda: client.responses.input_items.list(response_id),
        lambda: _create(client, previous_response_id=response_id, input="more"),
        lambda: client.responses.delete(response_id),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError):
            call()


def test_the_disk_store_outlives_a_restart_and_keeps_open_mode_apart_from_keys(
        serve: Serve, tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    with serve(Settings(model_id="unused", cache_dir=cache)) as url:
        first = _create(sdk(url), input="Remember this.")
    with serve(Settings(model_id="unused", cache_dir=cache)) as url:
        client = sdk(url)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        second = _create(client, previous_response_id=first.id, input="And this.")
        texts = [i.content[0].text for i in client.responses.input_items.list(
            second.id, order="asc").data]
        assert texts == ["Remember this.", first.output_text, "And this."]
    with serve(Settings(model_id="unused", cache_dir=cache, admin_key=ADMIN_KEY)) as url:
        key = new_key(url, ADMIN_KEY, "after-open-mode")
        _invisible_to(sdk(url, key), first.id)  # an open-mode caller's, not this key's
    with serve(Settings(model_id="unused", cache_dir=str(tmp_path / "other"))) as url:
        with pytest.raises(openai.NotFoundError):
            sdk(url).responses.retrieve(first.id)


def test_gateways_on_one_redis_share_responses_each_seen_by_its_key_alone(
        serve: Serve, redis_server: RedisServer, tmp_path: Path) -> None:
    settings = Settings(model_id="unused", admin_key=ADMIN_KEY, redis_url=redis_server.url,
                        responses_ttl=TTL_S, cache_dir=str(tmp_path / "unused"))
    with serve(settings) as url_a, serve(settings) as url_b:
        owner, other = new_key(url_a, ADMIN_KEY, "owner"), new_key(url_a, ADMIN_KEY, "other")
        made = _create(sdk(url_a, owner), input="Shared?")
        on_b = sdk(url_b, owner)
        assert on_b.responses.retrieve(made.id).output_text == made.output_text
        after = _create(on_b, previous_response_id=made.id, input="Yes.")
        assert [i.type for i in on_b.responses.input_items.list(after.id).data] == [
            "message"] * 3
        ttl_ms = int(redis_server.command("PTTL", PREFIX + made.id))
        assert 0 < ttl_ms <= TTL_S * 1000
        for stranger in (sdk(url_b, other), sdk(url_a, ADMIN_KEY)):
            _invisible_to(stranger, made.id)
        sdk(url_a, owner).responses.delete(made.id)
        _invisible_to(on_b, made.id)
        assert on_b.responses.retrieve(after.id).id == after.id
    assert not (tmp_path / "unused").exists()  # with Redis, nothing is written on disk
