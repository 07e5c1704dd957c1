"""Errors answered outside Ollama's routes are in Ollama's shape on /api/ too, over a real
server: the body limit (413), the browser guard (403), a wrong method (405), an unknown path
(404); and `ollama` raises each with its status and message."""

from __future__ import annotations

import httpx
import ollama
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import ServeApp
from tests.gateway.echo_backend import EchoBackend

LIMIT = 4096


@pytest.fixture
def url(serve_app: ServeApp) -> str:
    app = create_app(Settings(max_request_body_bytes=LIMIT),
                     backends={"echo": EchoBackend(name="echo")})
    return serve_app(app)


def _only_error(answer: httpx.Response, status: int) -> str:
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)
    return body["error"]


def test_a_body_over_the_limit_is_ollamas_413(url: str) -> None:
    client = ollama.Client(host=url, timeout=10)
    with pytest.raises(ollama.ResponseError) as large:
        client.chat(model="echo", messages=[{"role": "user", "content": "x" * LIMIT}])
    assert large.value.status_code == 413 and str(LIMIT) in large.value.error
    big = httpx.post(f"{url}/api/generate", content=b"{" + b" " * LIMIT + b"}",
                     headers={"content-type": "application/json"}, timeout=10)
    _only_error(big, 413)


def test_a_rebound_host_is_ollamas_403(url: str) -> None:
    answer = httpx.post(f"{url}/api/chat", json={"model": "echo"}, timeout=10,
                        headers={"host": "evil.example"})
    assert "loopback" in _only_error(answer, 403)


def test_wrong_methods_and_paths_are_ollamas(url: str) -> None:
    _only_error(httpx.get(f"{url}/api/chat", timeout=10), 405)
    _only_error(httpx.post(f"{url}/api/pull", json={"model": "echo"}, timeout=10), 404)
    # Elsewhere, OpenAI's shape as before.
    assert httpx.get(f"{url}/v1/chat/completions", timeout=10).json()["error"]["message"]
