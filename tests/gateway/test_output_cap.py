"""--max-output-tokens is also the ceiling of a request that sets no limit: OpenAI's routes
generate min(room left in the context, cap); TGI's default of 100 never exceeds the cap."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from gateway.app import create_app
from gateway.limits import output_ceiling
from gateway.settings import Settings
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend

CAP = 12
CONTEXT = 200


@pytest.fixture(scope="module")
def echo() -> EchoBackend:
    return EchoBackend(name="echo", max_total_tokens=CONTEXT, natural_length=10_000)


@pytest.fixture(scope="module")
def http(echo: EchoBackend) -> Iterator[httpx.Client]:
    app = create_app(Settings(max_output_tokens=CAP), backends={"echo": echo})
    with running_server(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield client


def _chat(http: httpx.Client, words: int, **extra: object) -> dict:
    body = {"model": "echo", "messages": [{"role": "user", "content": "w " * words}], **extra}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_openai_requests_without_max_tokens_stop_at_the_cap(http: httpx.Client,
                                                            echo: EchoBackend) -> None:
    out = _chat(http, 3)
    assert out["usage"]["completion_tokens"] == CAP
    assert out["choices"][0]["finish_reason"] == "length"
    assert echo.requests[-1].sampling.max_tokens == CAP
    assert _chat(http, 3, max_tokens=5)["usage"]["completion_tokens"] == 5
    near_the_end = _chat(http, CONTEXT - 5)  # room for 5 more tokens: fewer than the cap
    assert near_the_end["usage"]["completion_tokens"] == 5
    body = {"model": "echo", "prompt": "a b c", "stream": True,
            "stream_options": {"include_usage": True}}
    text = http.post("/v1/completions", json=body).text.replace(" ", "")
    assert f'"completion_tokens":{CAP}' in text


def test_tgi_default_and_null_max_new_tokens_stop_at_the_cap(http: httpx.Client) -> None:
    for parameters in ({}, {"max_new_tokens": None}, {"max_new_tokens": 4}):
        response = http.post("/generate", json={"inputs": "a b c", "parameters": parameters})
        assert response.status_code == 200, response.text
        expected = parameters.get("max_new_tokens") or CAP
        assert response.headers["x-generated-tokens"] == str(expected), parameters


def test_output_ceiling() -> None:
    assert output_ceiling(None, 10, 100, None) is None  # no cap: up to the context
    assert output_ceiling(100, 10, 4096, 150) == 100  # TGI's default stays under a larger cap
    assert output_ceiling(100, 10, 4096, 20) == 20
    assert output_ceiling(None, 10, 4096, 20) == 20
    assert output_ceiling(None, 90, 100, 20) == 10  # the room left
    assert output_ceiling(None, 100, 100, 20) is None  # no room: the backend refuses
