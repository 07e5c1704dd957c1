"""/v1/embeddings under API keys, with real Redis: its inputs' tokens are its prompt, charged
to the key's usage, budget and tokens per minute as a generation's prompt is; requests per
minute, the model allow-list and a client that leaves behave as for generations."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.auth.conftest import ADMIN_KEY, RedisServer, create_key
from tests.auth.test_replicas import model_usage, usage, wait_until
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend
from tests.gateway.echo_embedding import EchoEmbeddingBackend

EMBED, SLOW, CHAT = "embedder", "slow-embedder", "chat"
INPUTS = ["one two three", "four five six"]  # six tokens (the stand-in counts words)


@pytest.fixture(scope="module")
def url(redis_server: RedisServer) -> Iterator[str]:
    backends = {EMBED: EchoEmbeddingBackend(name=EMBED),
                SLOW: EchoEmbeddingBackend(name=SLOW, delay_s=5.0), CHAT: EchoBackend(name=CHAT)}
    settings = Settings(model_id="unused", redis_url=redis_server.url, admin_key=ADMIN_KEY)
    with running_server(create_app(settings, backends=backends)) as base:
        yield base


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10)


def test_usage_and_budget_count_the_inputs_tokens(url: str) -> None:
    made = create_key(url, name="embed-usage", budget=1000)
    out = _client(url, made["key"]).embeddings.create(model=EMBED, input=INPUTS)
    assert out.usage.prompt_tokens == 6
    wait_until(lambda: model_usage(url, made["id"], EMBED)["requests"] == 1)
    row = model_usage(url, made["id"], EMBED)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (6, 0)
    assert usage(url, made["id"])["budget"]["used"] == 6


def test_tokens_per_minute_and_requests_per_minute_refuse(url: str) -> None:
    small = create_key(url, name="embed-tpm", tpm=5)
    with pytest.raises(openai.RateLimitError):
        _client(url, small["key"]).embeddings.create(model=EMBED, input=INPUTS)
    once = _client(url, create_key(url, name="embed-rpm", rpm=1)["key"])
    once.embeddings.create(model=EMBED, input="hello")
    with pytest.raises(openai.RateLimitError) as caught:
        once.embeddings.create(model=EMBED, input="hello")
    assert caught.value.response.headers.get("retry-after")


def test_the_allow_list_comes_before_the_task(url: str) -> None:
    """A key learns nothing of a model it may not use, its task included."""
    chat_only = _client(url, create_key(url, name="chat-only", models=[CHAT])["key"])
    with pytest.raises(openai.PermissionDeniedError):
        chat_only.embeddings.create(model=EMBED, input="x")
    with pytest.raises(openai.BadRequestError, match="task: generate"):
        chat_only.embeddings.create(model=CHAT, input="x")
    with pytest.raises(openai.PermissionDeniedError):
        chat_only.chat.completions.create(model=EMBED, messages=[{"role": "user",
                                                                  "content": "x"}])
    embed_only = _client(url, create_key(url, name="embed-only", models=[EMBED])["key"])
    with pytest.raises(openai.PermissionDeniedError):
        embed_only.embeddings.create(model=CHAT, input="x")


def test_a_client_gone_while_embedding_pays_its_inputs(url: str) -> None:
    made = create_key(url, name="embed-gone", budget=1000, parallel=2)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/embeddings", json={"model": SLOW, "input": INPUTS},
                   headers={"Authorization": f"Bearer {made['key']}"},
                   timeout=httpx.Timeout(10, read=0.5))
    wait_until(lambda: model_usage(url, made["id"], SLOW)["prompt_tokens"] > 0)
    assert model_usage(url, made["id"], SLOW)["prompt_tokens"] == 6
    assert usage(url, made["id"])["budget"]["used"] == 6
