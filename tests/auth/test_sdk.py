"""The real openai SDK against the gateway replicas (real engine): the right exceptions,
with OpenAI's rate limit headers."""

from __future__ import annotations

import openai
import pytest

from tests.auth.conftest import ADMIN_KEY, Replica, create_key

MESSAGES = [{"role": "user", "content": "Say something about keys."}]


def sdk(replica: Replica, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{replica.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_authentication_error(replicas: tuple[Replica, Replica]) -> None:
    a, _ = replicas
    for key in ("sk-sy-not-a-real-key", "no-prefix"):
        with pytest.raises(openai.AuthenticationError) as caught:
            sdk(a, key).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        assert caught.value.status_code == 401
        assert caught.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        sdk(a, "sk-sy-nope").models.list()


def test_permission_denied_for_a_model_the_key_may_not_use(
    replicas: tuple[Replica, Replica],
) -> None:
    a, b = replicas
    key = create_key(a.url, name="slow-only", models=["slow"])["key"]
    with pytest.raises(openai.PermissionDeniedError) as caught:
        sdk(b, key).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert caught.value.status_code == 403 and caught.value.code == "model_not_allowed"
    with pytest.raises(openai.PermissionDeniedError):
        sdk(b, key).models.retrieve("tiny")
    assert [m.id for m in sdk(a, key).models.list().data] == ["slow"]
    assert sdk(a, key).chat.completions.create(model="slow", messages=MESSAGES,
                                               max_tokens=2).choices[0].message.content


def test_rate_limit_error_with_headers(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    key = create_key(a.url, name="sdk-rpm", rpm=2, tpm=5000)["key"]
    raw = sdk(a, key).chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=3, temperature=0)
    assert raw.headers["x-ratelimit-limit-requests"] == "2"
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"
    assert raw.headers["x-ratelimit-limit-tokens"] == "5000"
    completion = raw.parse()
    assert completion.usage.completion_tokens == 3
    reserved = completion.usage.prompt_tokens + 3
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) == 5000 - reserved
    assert raw.headers["x-ratelimit-reset-requests"].endswith("s")

    streamed = sdk(b, key).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, stream=True,
        stream_options={"include_usage": True})
    assert list(streamed)[-1].usage.completion_tokens == 3

    with pytest.raises(openai.RateLimitError) as caught:
        sdk(b, key).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    error = caught.value
    assert error.status_code == 429 and error.code == "rate_limit_exceeded"
    headers = error.response.headers
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-remaining-requests"] == "0"
    for name in ("limit-requests", "reset-requests", "limit-tokens", "remaining-tokens",
                 "reset-tokens"):
        assert f"x-ratelimit-{name}" in headers


def test_the_admin_key_may_call_models(replicas: tuple[Replica, Replica]) -> None:
    a, _ = replicas
    out = sdk(a, ADMIN_KEY).completions.create(model="tiny", prompt="Once", max_tokens=2)
    assert out.usage.completion_tokens == 2
