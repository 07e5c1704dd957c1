"""Two gateway processes sharing one real Redis enforce one set of limits, exactly.

`tiny` is the real native engine; `slow` is the echo stand-in (50 ms a token), used
where a request must stay in flight for a while (parallel cap, disconnects).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.auth.conftest import Replica, admin_headers, create_key

PROMPT = [{"role": "user", "content": "Count the stars in the night sky."}]


def chat(url: str, key: str, model: str = "tiny", **body: Any) -> httpx.Response:
    payload = {"model": model, "messages": PROMPT, "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})


def usage(url: str, key_id: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/admin/keys/{key_id}/usage", headers=admin_headers(), timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def model_usage(url: str, key_id: str, model: str) -> dict[str, Any]:
    rows = [row for row in usage(url, key_id)["data"] if row["model"] == model]
    return rows[0] if rows else {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}


def wait_until(check: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_requests_per_minute_is_exact_across_replicas(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    made = create_key(a.url, name="rpm", rpm=6)
    key = made["key"]
    with ThreadPoolExecutor(12) as pool:  # a burst of 12 at once, alternating replicas
        answers = list(pool.map(lambda i: chat((a, b)[i % 2].url, key, max_tokens=2), range(12)))
    codes = [r.status_code for r in answers]
    assert codes.count(200) == 6 and codes.count(429) == 6, codes
    for refused in (r for r in answers if r.status_code == 429):
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert refused.headers["x-ratelimit-limit-requests"] == "6"
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    for replica in (a, b):  # the next one, on either replica, is refused too
        assert chat(replica.url, key).status_code == 429
    assert model_usage(b.url, made["id"], "tiny")["requests"] == 6


def test_tokens_per_minute_are_charged_by_actual_usage(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    probe = create_key(a.url, name="probe")["key"]
    greedy = chat(a.url, probe, max_tokens=16).json()
    prompt = greedy["usage"]["prompt_tokens"]
    text = greedy["choices"][0]["message"]["content"]
    stop = next(text[i:i + 2] for i in range(len(text) // 3, len(text)) if text[i:i + 2].strip())

    reserve = prompt + 100
    made = create_key(a.url, name="tpm", tpm=2 * reserve - 1)  # two reservations do not fit
    key = made["key"]
    first = chat(a.url, key, max_tokens=100, stop=[stop])  # same greedy text, cut early
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["finish_reason"] == "stop"
    used = first.json()["usage"]["total_tokens"]
    assert used < reserve
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 2 * reserve - 1 - reserve

    second = chat(b.url, key, max_tokens=100, stop=[stop])  # fits only if `first` gave back
    assert second.status_code == 200, second.text
    assert int(second.headers["x-ratelimit-remaining-tokens"]) == 2 * reserve - 1 - used - reserve
    room = 2 * reserve - 1 - 2 * used  # what is left of the minute's tokens
    third = chat(a.url, key, max_tokens=room - prompt + 1, stop=[stop])  # one token too many
    assert third.status_code == 429
    assert third.headers["x-ratelimit-limit-tokens"] == str(2 * reserve - 1)
    assert third.headers["x-ratelimit-remaining-tokens"] == str(room)
    assert "tokens per minute" in third.json()["error"]["message"]
    assert chat(b.url, key, max_tokens=room - prompt, stop=[stop]).status_code == 200  # fits
    row = model_usage(a.url, made["id"], "tiny")
    assert row["requests"] == 3 and row["prompt_tokens"] + row["completion_tokens"] == 3 * used


def test_a_disconnected_stream_is_charged_what_it_used(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    made = create_key(a.url, name="disconnect", tpm=3000, parallel=1)
    key = made["key"]
    body = {"model": "slow", "messages": [{"role": "user", "content": "one two three"}],
            "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{a.url}/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200
        assert response.headers["x-ratelimit-remaining-tokens"] == str(3000 - 1003)
        frames = (line for line in response.iter_lines() if line.startswith("data:"))
        for _ in range(3):  # the role chunk, then tokens
            next(frames)
        assert chat(b.url, key, model="slow").status_code == 429  # the one slot is taken
    # Leaving the block dropped the connection: the slot is freed and tokens settled.
    wait_until(lambda: model_usage(b.url, made["id"], "slow")["requests"] == 1)
    row = model_usage(b.url, made["id"], "slow")
    assert row["prompt_tokens"] == 3 and 1 <= row["completion_tokens"] < 100
    after = chat(b.url, key, model="slow", max_tokens=5)
    assert after.status_code == 200, after.text
    charged = row["prompt_tokens"] + row["completion_tokens"]
    echo_prompt = len(PROMPT[0]["content"].split())  # the echo backend counts words
    assert int(after.headers["x-ratelimit-remaining-tokens"]) == 3000 - charged - (echo_prompt + 5)


def test_a_client_that_gives_up_on_a_plain_request_is_settled(
    replicas: tuple[Replica, Replica],
) -> None:
    a, b = replicas
    made = create_key(a.url, name="gave-up", parallel=1, budget=100_000)
    key = made["key"]
    with pytest.raises(httpx.ReadTimeout):  # the client closes the connection after 0.3 s
        httpx.post(f"{a.url}/v1/chat/completions", timeout=httpx.Timeout(10, read=0.3),
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": "slow", "messages": PROMPT, "max_tokens": 1000,
                         "ignore_eos": True})
    wait_until(lambda: model_usage(b.url, made["id"], "slow")["requests"] == 1)
    row = model_usage(b.url, made["id"], "slow")
    assert 1 <= row["completion_tokens"] < 100  # ~6 tokens at 50 ms each, not 1000
    assert usage(b.url, made["id"])["budget"]["used"] == row["prompt_tokens"] + \
        row["completion_tokens"]
    assert chat(b.url, key, model="slow").status_code == 200  # the parallel slot is free


def _open_stream(client: httpx.Client, url: str, key: str) -> tuple[httpx.Response, Any]:
    """A streamed request left running (the line iterator must stay alive with it)."""
    body = {"model": "slow", "messages": [{"role": "user", "content": "hold"}],
            "max_tokens": 400, "stream": True, "ignore_eos": True}
    request = client.build_request("POST", f"{url}/v1/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"})
    response = client.send(request, stream=True)
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    next(lines)
    return response, lines


def test_parallel_cap_holds_across_replicas(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    made = create_key(a.url, name="parallel", parallel=2)
    key = made["key"]
    with httpx.Client(timeout=30) as client:
        held = [_open_stream(client, a.url, key), _open_stream(client, b.url, key)]
        for replica in (a, b):
            refused = chat(replica.url, key, model="slow")
            assert refused.status_code == 429
            assert "parallel" in refused.json()["error"]["message"]
            assert refused.headers["retry-after"] == "1"
        held[0][0].close()
        wait_until(lambda: chat(b.url, key, model="slow", max_tokens=1).status_code == 200)
        held[1][0].close()


def test_budget_runs_out_across_replicas(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    probe = create_key(a.url, name="probe")["key"]
    per_request = chat(a.url, probe).json()["usage"]["total_tokens"]  # prompt + 4, by length
    made = create_key(b.url, name="budget", budget=3 * per_request)
    key = made["key"]
    for replica in (a, b, a):
        assert chat(replica.url, key).status_code == 200
    refused = chat(b.url, key)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "insufficient_quota" and "budget" in error["message"]
    assert refused.headers["x-should-retry"] == "false"
    assert usage(a.url, made["id"])["budget"]["remaining"] == 0

    periodic = create_key(a.url, name="daily", budget=per_request, budget_period="1d")
    assert chat(b.url, periodic["key"]).status_code == 200
    again = chat(a.url, periodic["key"])
    assert again.status_code == 429
    assert 0 < int(again.headers["retry-after"]) <= 86400
    assert "renews every 24h0m0s" in again.json()["error"]["message"]


def test_revocation_takes_effect_at_once_on_both(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    made = create_key(a.url, name="revoke-me")
    key = made["key"]
    assert chat(a.url, key).status_code == 200 and chat(b.url, key).status_code == 200
    gone = httpx.delete(f"{a.url}/admin/keys/{made['id']}", headers=admin_headers())
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    for replica in (b, a):
        refused = chat(replica.url, key)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"


def test_disabling_and_expiry_take_effect_at_once_on_both(
    replicas: tuple[Replica, Replica],
) -> None:
    a, b = replicas
    made = create_key(a.url, name="toggle")
    key, path = made["key"], f"/admin/keys/{made['id']}"
    off = httpx.patch(f"{b.url}{path}", json={"disabled": True}, headers=admin_headers())
    assert off.status_code == 200 and off.json()["disabled"] is True
    assert "disabled" in chat(a.url, key).json()["error"]["message"]
    httpx.patch(f"{a.url}{path}", json={"disabled": False}, headers=admin_headers())
    assert chat(b.url, key).status_code == 200

    expiring = create_key(b.url, name="short-lived", expires_in=1.5)
    assert chat(a.url, expiring["key"]).status_code == 200
    assert chat(b.url, expiring["key"]).status_code == 200
    time.sleep(max(expiring["expires_at"] - time.time(), 0) + 0.05)
    for replica in (a, b):
        refused = chat(replica.url, expiring["key"])
        assert refused.status_code == 401 and "expired" in refused.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", "/v1/completions"])
def test_every_inference_route_needs_a_key(replicas: tuple[Replica, Replica], path: str) -> None:
    a, _ = replicas
    method = "GET" if path == "/v1/models" else "POST"
    answer = httpx.request(method, f"{a.url}{path}", content=b"{not json")
    assert answer.status_code == 401  # before the body is even parsed
    assert answer.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{a.url}/health").status_code == 200
