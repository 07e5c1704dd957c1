"""Client disconnects abort the backend request; other requests carry on."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.gateway.echo_backend import EchoBackend

MESSAGES = [{"role": "user", "content": "talk for a long time"}]
LONG = {"max_tokens": 5000, "extra_body": {"ignore_eos": True}}


def _wait_for(predicate, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def _short_request(client: openai.OpenAI) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model="slow", messages=MESSAGES, max_tokens=20,
                                          extra_body={"ignore_eos": True})


def test_stream_disconnect_aborts_while_another_completes(
    client: openai.OpenAI, echo_backends: dict[str, EchoBackend],
) -> None:
    slow = echo_backends["slow"]
    aborted_before = len(slow.aborted)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(_short_request, client)
        stream = client.chat.completions.create(model="slow", messages=MESSAGES, stream=True,
                                                **LONG)
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        stream.close()
        assert _wait_for(lambda: len(slow.aborted) > aborted_before), "backend never aborted"
        done = other.result(timeout=10)
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 20
    assert slow.running == 0


def test_non_stream_disconnect_aborts(
    gateway_url: str, echo_backends: dict[str, EchoBackend], http: httpx.Client,
) -> None:
    slow = echo_backends["slow"]
    aborted_before = len(slow.aborted)
    body = {"model": "slow", "messages": MESSAGES, "max_tokens": 5000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=0.3)
    assert _wait_for(lambda: len(slow.aborted) > aborted_before), "backend never aborted"
    assert _wait_for(lambda: slow.running == 0)
    # The 499 is counted when the request's handler unwinds, which may follow the abort.
    assert _wait_for(
        lambda: 'route="/v1/chat/completions",status="499"' in http.get("/metrics").text
    ), "no 499 counted for the disconnected request"


def test_many_concurrent_streams_with_failures(
    client: openai.OpenAI, echo_backends: dict[str, EchoBackend],
) -> None:
    def one(i: int) -> str:
        content = "FAIL_MIDWAY" if i % 3 == 0 else f"request {i}"
        try:
            chunks = client.chat.completions.create(
                model="slow", messages=[{"role": "user", "content": content}], max_tokens=5,
                stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        except openai.APIError:
            return "error"

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(12)))
    for i, result in enumerate(results):
        assert result == ("error" if i % 3 == 0 else "alpha beta gamma delta epsilon")
    assert _wait_for(lambda: echo_backends["slow"].running == 0)
