"""A key's limits are checked before the gateway spends work on its request: /tokenize and
/detokenize are admitted like generations (requests per minute, parallel requests), and a
key over a limit, or not allowed the model, costs no tokenization or template rendering.

A real server with the real native engine on a tiny model and real Redis; every call into
the model's tokenizer (prompt counting, chat templates, /tokenize) is counted in-process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.base import GenerationRequest
from backends.cpu_kernels.status import SETTING
from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.auth.conftest import ADMIN_KEY, RedisServer, create_key
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend

TINY, SLOW = "tiny", "slow"
MESSAGES = [{"role": "user", "content": "Tell me a story about a brave little toaster."}]


@dataclass
class TokenizerCalls:
    """Counts calls into a backend's tokenizer (count_tokens and generate go through it)."""

    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(self, backend: NativeBackend) -> None:
        tokenize = backend.tokenize

        def counted(req: GenerationRequest) -> list[int]:
            with self.lock:
                self.calls += 1
            return tokenize(req)

        backend.tokenize = counted  # type: ignore[method-assign]


@dataclass
class Server:
    url: str
    tokenizer: TokenizerCalls


@pytest.fixture(scope="module")
def server(redis_server: RedisServer, tiny_model: Callable[[str], Path]) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv(SETTING, "off")  # torch's own ops: what is measured is the tokenizer
        yield from _serve(redis_server, tiny_model)


def _serve(redis_server: RedisServer, tiny_model: Callable[[str], Path]) -> Iterator[Server]:
    config = EngineConfig(model=str(tiny_model("llama_gqa")), served_model_name=TINY,
                          dtype="float32", max_total_tokens=256, max_batch_total_tokens=1024,
                          block_size=8, compile=False)
    tiny = NativeBackend(config)
    calls = TokenizerCalls()
    calls.wrap(tiny)
    slow = EchoBackend(name=SLOW, max_total_tokens=100_000, delay_s=1.0)
    settings = Settings(model_id="unused", redis_url=redis_server.url, admin_key=ADMIN_KEY,
                        max_output_tokens=8)
    app = create_app(settings, backends={TINY: tiny, SLOW: slow})
    with running_server(app, timeout_s=120) as url:
        yield Server(url, calls)


def post(server: Server, path: str, key: str, body: dict[str, Any],
         headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})})


def _assert_rate_limited(answer: httpx.Response) -> None:
    assert answer.status_code == 429, answer.text
    error = answer.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert "requests per minute" in error["message"]
    assert 1 <= int(answer.headers["retry-after"]) <= 60
    assert answer.headers["x-ratelimit-remaining-requests"] == "0"


@pytest.mark.parametrize(("path", "body"), [
    ("/tokenize", {"model": TINY, "prompt": "Once upon a time"}),
    ("/tokenize", {"model": TINY, "messages": MESSAGES}),
    ("/detokenize", {"model": TINY, "tokens": [1, 2, 3]}),
])
def test_tokenize_routes_count_against_requests_per_minute(
    server: Server, path: str, body: dict[str, Any],
) -> None:
    key = create_key(server.url, name="tokenize-rpm", rpm=1)["key"]
    answers = [post(server, path, key, body) for _ in range(5)]
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].headers["x-ratelimit-remaining-requests"] == "0"
    for refused in answers[1:]:
        _assert_rate_limited(refused)


def test_tokenize_counts_against_parallel_requests(server: Server) -> None:
    key = create_key(server.url, name="tokenize-parallel", parallel=1)["key"]
    body = {"model": SLOW, "messages": [{"role": "user", "content": "hold"}],
            "max_tokens": 8, "stream": True, "ignore_eos": True}  # 8 s, one token a second
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as held:
        assert held.status_code == 200
        before = server.tokenizer.calls
        refused = post(server, "/tokenize", key, {"model": TINY, "prompt": "a b c"})
        assert refused.status_code == 429, refused.text
        assert "parallel" in refused.json()["error"]["message"]
        assert server.tokenizer.calls == before
    assert post(server, "/tokenize", key, {"model": TINY, "prompt": "a b c"}).status_code == 200


def _refused_without_tokenizing(server: Server, make: Callable[[], httpx.Response],
                                status: int, times: int = 3) -> list[httpx.Response]:
    before = server.tokenizer.calls
    answers = [make() for _ in range(times)]
    assert [a.status_code for a in answers] == [status] * times, answers[0].text
    assert server.tokenizer.calls == before  # not one call into the tokenizer
    return answers


def test_a_key_over_its_rate_costs_no_tokenization(server: Server) -> None:
    """A key whose limits count tokens needs its prompt counted to reserve them: only once
    its request limit has room. No `max_tokens`: the output cap counts the prompt too."""
    key = create_key(server.url, name="over-rpm", rpm=1, tpm=100_000)["key"]
    chat = {"model": TINY, "messages": MESSAGES, "temperature": 0}
    assert post(server, "/v1/chat/completions", key, chat).status_code == 200
    for answer in _refused_without_tokenizing(
            server, lambda: post(server, "/v1/chat/completions", key, chat), 429):
        _assert_rate_limited(answer)
    completion = {"model": TINY, "prompt": "Once upon a time", "max_tokens": 2}
    _refused_without_tokenizing(server, lambda: post(server, "/v1/completions", key, completion),
                                429)


def test_a_key_over_its_rate_costs_no_tokenization_on_tgi_routes(server: Server) -> None:
    key = create_key(server.url, name="over-rpm-tgi", rpm=1)["key"]
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 2, "truncate": 3}}
    headers = {"x-model": TINY}
    assert post(server, "/generate", key, body, headers).status_code == 200
    answers = _refused_without_tokenizing(
        server, lambda: post(server, "/generate", key, body, headers), 429)
    assert answers[0].json()["error_type"]  # TGI's shape
    # 3 prompt tokens (truncated) + 1 generated spend the whole budget.
    one = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 1, "truncate": 3}}
    budget_key = create_key(server.url, name="spent-tgi", budget=4)["key"]
    assert post(server, "/generate", budget_key, one, headers).status_code == 200
    spent = _refused_without_tokenizing(
        server, lambda: post(server, "/generate_stream", budget_key, one, headers), 429)
    assert "budget" in spent[0].json()["error"]


def test_a_key_not_allowed_the_model_costs_no_tokenization(server: Server) -> None:
    key = create_key(server.url, name="other-model", models=[SLOW], tpm=100_000)["key"]
    chat = {"model": TINY, "messages": MESSAGES}  # no max_tokens: the output cap would count
    for answer in _refused_without_tokenizing(
            server, lambda: post(server, "/v1/chat/completions", key, chat), 403):
        assert answer.json()["error"]["code"] == "model_not_allowed"
    _refused_without_tokenizing(
        server, lambda: post(server, "/generate", key, {"inputs": "a b"}, {"x-model": TINY}), 403)
    _refused_without_tokenizing(
        server, lambda: post(server, "/tokenize", key, {"model": TINY, "prompt": "a b"}), 403)
