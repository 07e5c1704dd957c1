"""Per-key series on /metrics: the tokens a key used (equal to its usage in Redis), the
requests its limits refused, and nothing left of a key once it is revoked."""

from __future__ import annotations

import re

import httpx

from gateway.app import create_app
from gateway.settings import Settings
from tests.auth.conftest import ADMIN_KEY, RedisServer, admin_headers, create_key
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "one two three"}],
        "max_tokens": 5}


def _series(text: str, name: str, key_id: str) -> dict[str, float]:
    """label value after key_id -> sample, for `name`'s series of this key."""
    pattern = rf'^{name}_total{{key_id="{re.escape(key_id)}",\w+="([^"]+)"}} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE)}


def test_key_series_follow_usage_refusals_and_revocation(redis_server: RedisServer) -> None:
    settings = Settings(admin_key=ADMIN_KEY, redis_url=redis_server.url)
    app = create_app(settings, backends={"echo": EchoBackend(name="echo")})
    with running_server(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        made = create_key(url, name="metered", rpm=2)
        user = {"Authorization": f"Bearer {made['key']}"}
        answers = [http.post("/v1/chat/completions", json=CHAT, headers=user) for _ in range(3)]
        assert [a.status_code for a in answers] == [200, 200, 429]
        prompt = sum(a.json()["usage"]["prompt_tokens"] for a in answers[:2])
        completion = sum(a.json()["usage"]["completion_tokens"] for a in answers[:2])

        text = http.get("/metrics").text
        assert _series(text, "switchyard_key_tokens", made["id"]) == {
            "prompt": prompt, "completion": completion}
        assert _series(text, "switchyard_key_rate_limited", made["id"]) == {"requests": 1.0}
        usage = http.get(f"/admin/keys/{made['id']}/usage", headers=admin_headers()).json()
        assert [(u["prompt_tokens"], u["completion_tokens"]) for u in usage["data"]] == [
            (prompt, completion)]
        assert completion > 0
        assert made["key"] not in text

        assert http.delete(f"/admin/keys/{made['id']}", headers=admin_headers()).is_success
        assert made["id"] not in http.get("/metrics").text
