"""/admin/keys, usage, /v1/models filtering, /health and /metrics access, in one process:
keys in memory or in the config file. The echo stand-in serves (generation is irrelevant)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from auth.keys import hash_key
from gateway.app import create_app
from gateway.settings import Settings
from tests.auth.conftest import ADMIN_KEY, admin_headers
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend

CHAT = {"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    settings = Settings(admin_key=ADMIN_KEY, metrics_auth="admin")
    backends = {"echo": EchoBackend(name="echo"), "other": EchoBackend(name="other")}
    with running_server(create_app(settings, backends=backends)) as base:
        yield base


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=10) as client:
        yield client


def test_admin_endpoints_need_the_admin_key(http: httpx.Client) -> None:
    assert http.get("/admin/keys").status_code == 401
    assert http.get("/admin/keys", headers=bearer("sk-sy-wrong")).status_code == 401
    user = http.post("/admin/keys", json={"name": "u"}, headers=admin_headers()).json()["key"]
    refused = http.get("/admin/keys", headers=bearer(user))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
    assert http.post("/admin/keys", json={}, headers=bearer(user)).status_code == 403


def test_create_list_get_update_revoke(http: httpx.Client) -> None:
    made = http.post("/admin/keys", headers=admin_headers(), json={
        "name": "crud", "models": ["echo"], "rpm": 10, "budget": 500, "budget_period": "1d",
        "expires_in": "30d"})
    assert made.status_code == 201, made.text
    body = made.json()
    secret, key_id = body["key"], body["id"]
    assert secret.startswith("sk-sy-") and len(secret) >= 40 and key_id.startswith("key_")
    assert body["budget_period"] == 86400 and body["expires_at"] > body["created_at"]
    assert "key_hash" not in body
    listing = http.get("/admin/keys", headers=admin_headers()).text
    assert key_id in listing and secret not in listing and hash_key(secret) not in listing
    one = http.get(f"/admin/keys/{key_id}", headers=admin_headers()).json()
    assert one["rpm"] == 10 and "key" not in one
    changed = http.patch(f"/admin/keys/{key_id}", json={"rpm": 20, "models": None},
                         headers=admin_headers()).json()
    assert changed["rpm"] == 20 and changed["models"] is None and changed["budget"] == 500
    assert http.post("/v1/chat/completions", json={"model": "other", **CHAT},
                     headers=bearer(secret)).status_code == 200
    assert http.delete(f"/admin/keys/{key_id}", headers=admin_headers()).status_code == 200
    assert http.get(f"/admin/keys/{key_id}", headers=admin_headers()).status_code == 404
    assert http.delete(f"/admin/keys/{key_id}", headers=admin_headers()).status_code == 404
    assert http.post("/v1/chat/completions", json={"model": "echo", **CHAT},
                     headers=bearer(secret)).status_code == 401


@pytest.mark.parametrize("body", [
    {"rpm": 0}, {"tpm": -1}, {"budget_period": "soon"}, {"expires_at": "not a date"},
    {"unknown": 1}, {"models": "echo"},
])
def test_invalid_key_options_are_400(http: httpx.Client, body: dict) -> None:
    answer = http.post("/admin/keys", json=body, headers=admin_headers())
    assert answer.status_code == 400, answer.text


def test_usage_is_per_model_and_readable_by_owner_and_admin(http: httpx.Client) -> None:
    made = http.post("/admin/keys", json={"name": "usage", "budget": 1000},
                     headers=admin_headers()).json()
    key, key_id = made["key"], made["id"]
    for model in ("echo", "echo", "other"):
        answer = http.post("/v1/chat/completions", json={"model": model, **CHAT},
                           headers=bearer(key))
        assert answer.status_code == 200
    own = http.get("/v1/usage", headers=bearer(key)).json()
    by_admin = http.get(f"/admin/keys/{key_id}/usage", headers=admin_headers()).json()
    by_owner = http.get(f"/admin/keys/{key_id}/usage", headers=bearer(key)).json()
    assert own == by_admin == by_owner
    rows = {row["model"]: row for row in own["data"]}
    assert rows["echo"] == {"model": "echo", "requests": 2, "prompt_tokens": 6,
                            "completion_tokens": 4, "total_tokens": 10}
    assert rows["other"]["requests"] == 1
    assert own["budget"]["used"] == 15 and own["budget"]["remaining"] == 985
    stranger = http.post("/admin/keys", json={}, headers=admin_headers()).json()["key"]
    assert http.get(f"/admin/keys/{key_id}/usage", headers=bearer(stranger)).status_code == 403


def test_models_are_guarded_and_filtered(http: httpx.Client) -> None:
    assert http.get("/v1/models").status_code == 401
    key = http.post("/admin/keys", json={"models": ["other"]}, headers=admin_headers()).json()
    listed = http.get("/v1/models", headers=bearer(key["key"])).json()
    assert [m["id"] for m in listed["data"]] == ["other"]
    assert http.get("/v1/models/echo", headers=bearer(key["key"])).status_code == 403
    assert http.get("/v1/models/other", headers=bearer(key["key"])).status_code == 200
    admin = http.get("/v1/models", headers=admin_headers()).json()
    assert [m["id"] for m in admin["data"]] == ["echo", "other"]


def test_key_is_checked_before_the_body(http: httpx.Client) -> None:
    answer = http.post("/v1/completions", content=b"\xff not json")
    assert answer.status_code == 401
    assert "Missing API key" in answer.json()["error"]["message"]
    basic = http.post("/v1/completions", content=b"{}", headers={"Authorization": "Basic eDp5"})
    assert basic.status_code == 401


def test_health_is_open_and_metrics_need_the_admin_key(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/metrics").status_code == 401
    user = http.post("/admin/keys", json={}, headers=admin_headers()).json()["key"]
    assert http.get("/metrics", headers=bearer(user)).status_code == 403
    assert http.get("/metrics", headers=admin_headers()).status_code == 200


def test_metrics_with_any_key_and_tgi_routes_need_a_key() -> None:
    settings = Settings(admin_key=ADMIN_KEY, metrics_auth="key")
    with running_server(create_app(settings, backends={"echo": EchoBackend()})) as base:
        assert httpx.get(f"{base}/metrics").status_code == 401
        user = httpx.post(f"{base}/admin/keys", json={}, headers=admin_headers()).json()["key"]
        assert httpx.get(f"{base}/metrics", headers=bearer(user)).status_code == 200
        for path in ("/generate", "/generate_stream"):
            refused = httpx.post(f"{base}{path}", json={"inputs": "a b"})
            assert refused.status_code == 401, path
            ok = httpx.post(f"{base}{path}", json={"inputs": "a b",
                            "parameters": {"max_new_tokens": 2}}, headers=bearer(user))
            assert ok.status_code == 200, ok.text


def test_keys_declared_in_the_config_file(tmp_path: Path) -> None:
    secret = "sk-sy-declared-in-the-config-file-0123456789"
    config = tmp_path / "switchyard.yaml"
    config.write_text(
        "models:\n  - name: echo\n    model_id: unused\n"
        f"keys:\n  - name: ops\n    id: key_ops\n    key_sha256: {hash_key(secret)}\n"
        "    models: [echo]\n    rpm: 2\n")
    settings = Settings(config_file=config)
    with running_server(create_app(settings, backends={"echo": EchoBackend()})) as base:
        def ask() -> httpx.Response:
            return httpx.post(f"{base}/v1/chat/completions", json={"model": "echo", **CHAT},
                              headers=bearer(secret))

        assert [ask().status_code for _ in range(3)] == [200, 200, 429]
        assert httpx.get(f"{base}/v1/usage", headers=bearer(secret)).json()["key_id"] == "key_ops"
        assert httpx.post(f"{base}/v1/chat/completions", json={"model": "echo", **CHAT},
                          headers=bearer(secret[:-1] + "x")).status_code == 401
        # No admin key configured: key administration is off, and says why.
        answer = httpx.get(f"{base}/admin/keys", headers=bearer(secret))
        assert answer.status_code == 403


def test_config_file_keys_are_read_only(tmp_path: Path) -> None:
    config = tmp_path / "switchyard.yaml"
    config.write_text("models:\n  - name: echo\n    model_id: unused\n"
                      f"keys:\n  - key_sha256: {hash_key('sk-sy-x')}\n")
    settings = Settings(config_file=config, admin_key=ADMIN_KEY)
    with running_server(create_app(settings, backends={"echo": EchoBackend()})) as base:
        answer = httpx.post(f"{base}/admin/keys", json={}, headers=admin_headers())
        assert answer.status_code == 409 and "config file" in answer.json()["error"]["message"]
        listed = httpx.get(f"{base}/admin/keys", headers=admin_headers()).json()["data"]
        assert len(listed) == 1


def test_open_mode_has_no_key_administration() -> None:
    with running_server(create_app(Settings(), backends={"echo": EchoBackend()})) as base:
        assert httpx.get(f"{base}/v1/models").status_code == 200
        assert httpx.get(f"{base}/admin/keys", headers=admin_headers()).status_code == 403


def test_tgi_routes_are_limited_and_metered(http: httpx.Client) -> None:
    made = http.post("/admin/keys", headers=admin_headers(), json={"name": "tgi", "rpm": 2})
    key_id, secret = made.json()["id"], made.json()["key"]
    body = {"inputs": "a b", "parameters": {"max_new_tokens": 2}}
    headers = {**bearer(secret), "x-model": "echo"}
    answers = [http.post("/generate", json=body, headers=headers) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert answers[2].headers["retry-after"] and "x-ratelimit-limit-requests" in answers[0].headers
    assert answers[2].json()["error_type"]  # TGI's error shape
    usage = http.get(f"/admin/keys/{key_id}/usage", headers=admin_headers()).json()
    (row,) = usage["data"]
    assert row["model"] == "echo" and row["requests"] == 2 and row["completion_tokens"] == 4
