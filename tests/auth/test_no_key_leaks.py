"""A full key life cycle through both replicas, all logged at DEBUG: no secret in the logs."""

from __future__ import annotations

import httpx

from auth.keys import hash_key
from tests.auth.conftest import ADMIN_KEY, Replica, admin_headers, create_key


def test_keys_never_appear_in_the_logs(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    made = create_key(a.url, name="leak-check", models=["tiny"], rpm=3, tpm=4000)
    secret, key_id = made["key"], made["id"]
    near_miss = secret[:-3] + "abc"
    auth = {"Authorization": f"Bearer {secret}"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

    assert httpx.post(f"{a.url}/v1/chat/completions", json=chat, headers=auth,
                      timeout=30).status_code == 200
    with httpx.stream("POST", f"{b.url}/v1/chat/completions", json={**chat, "stream": True},
                      headers=auth, timeout=30) as streamed:
        assert streamed.status_code == 200 and "[DONE]" in streamed.read().decode()
    assert httpx.post(f"{b.url}/v1/completions", json={"model": "slow", "prompt": "x"},
                      headers=auth).status_code == 403
    assert httpx.post(f"{a.url}/v1/completions", json={"model": "tiny", "prompt": "x",
                      "max_tokens": 2}, headers=auth).status_code == 200
    assert httpx.post(f"{b.url}/v1/chat/completions", json=chat,
                      headers=auth).status_code == 429
    assert httpx.post(f"{a.url}/v1/chat/completions", json=chat,
                      headers={"Authorization": f"Bearer {near_miss}"}).status_code == 401
    assert httpx.get(f"{b.url}/v1/usage", headers=auth).status_code == 200
    assert httpx.patch(f"{b.url}/admin/keys/{key_id}", json={"rpm": 10},
                       headers=admin_headers()).status_code == 200
    assert httpx.delete(f"{a.url}/admin/keys/{key_id}", headers=admin_headers()).status_code == 200
    assert httpx.get(f"{b.url}/v1/models", headers=auth).status_code == 401

    logs = a.logs() + b.logs()
    assert f"created API key {key_id}" in logs and f"revoked API key {key_id}" in logs
    assert '"POST /v1/chat/completions HTTP/1.1" 429' in logs  # the capture is real
    for needle in (secret, near_miss, ADMIN_KEY, hash_key(secret), secret[6:30]):
        assert needle not in logs
