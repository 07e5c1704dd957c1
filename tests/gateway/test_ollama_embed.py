"""Ollama's /api/embed (and the older /api/embeddings) on the native engine: a real uvicorn
server with keys on, the real `ollama` client beside the real openai SDK, the tiny random
Qwen3-Embedding-shaped decoder of test_native_embeddings.py served beside a generation model.

Both APIs take one path, so their vectors for the same inputs must be the same floats;
`truncate` cuts an over-long input to the model's first 255 tokens (the vector of those
tokens), or refuses it; the task is refused both ways in Ollama's error shape; the key is
charged the inputs' tokens.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import ollama
import openai
import pytest

from backends.native.embedding_backend import NativeEmbeddingBackend
from gateway.app import create_app
from gateway.settings import Settings
from tests.embedding_models import TEXTS
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend
from tests.gateway.test_native_embeddings import MODEL, backend, folder  # noqa: F401

CHAT = "echo"
ADMIN_KEY = "sy-admin-" + secrets.token_urlsafe(32)
MAX_INPUT = 255  # the backend's max_total_tokens - 1
LONG = "word " * 300


@pytest.fixture(scope="module")
def url(backend: NativeEmbeddingBackend) -> Iterator[str]:  # noqa: F811
    settings = Settings(model_id="unused", admin_key=ADMIN_KEY)
    app = create_app(settings, backends={MODEL: backend, CHAT: EchoBackend(name=CHAT)})
    with running_server(app, timeout_s=300) as base:
        yield base


def _key(url: str) -> str:
    answer = httpx.post(f"{url}/admin/keys", json={"name": "ollama-embed"},
                        headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert answer.status_code == 201, answer.text
    return answer.json()["key"]


@pytest.fixture(scope="module")
def key(url: str) -> str:
    return _key(url)


def _ollama(url: str, key: str) -> ollama.Client:
    return ollama.Client(host=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@pytest.fixture(scope="module")
def client(url: str, key: str) -> ollama.Client:
    return _ollama(url, key)


@pytest.fixture(scope="module")
def sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def _openai(sdk: openai.OpenAI, value: Any) -> tuple[np.ndarray, int]:
    out = sdk.embeddings.create(model=MODEL, input=value, encoding_format="float")
    return np.array([item.embedding for item in out.data]), out.usage.prompt_tokens


def test_embed_equals_v1_embeddings(client: ollama.Client, sdk: openai.OpenAI) -> None:
    out = client.embed(model=f"{MODEL}:latest", input=TEXTS)
    want, tokens = _openai(sdk, TEXTS)
    got = np.array(out.embeddings)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-6
    assert out.model == f"{MODEL}:latest" and out.prompt_eval_count == tokens
    assert out.load_duration == 0 and out.total_duration > 0


def test_a_single_string_is_one_input(client: ollama.Client, sdk: openai.OpenAI) -> None:
    out = client.embed(model=MODEL, input=TEXTS[1])
    want, tokens = _openai(sdk, TEXTS[1])
    assert len(out.embeddings) == 1 and out.prompt_eval_count == tokens
    assert np.abs(np.array(out.embeddings) - want).max() <= 1e-6
    legacy = client.embeddings(model=MODEL, prompt=TEXTS[1])
    assert np.abs(np.array([legacy.embedding]) - want).max() <= 1e-6


def test_truncate_cuts_to_the_window_or_refuses(
        client: ollama.Client, sdk: openai.OpenAI,
        backend: NativeEmbeddingBackend) -> None:  # noqa: F811
    cut = client.embed(model=MODEL, input=["short", LONG])
    assert cut.prompt_eval_count == len(_ids(backend, "short")) + MAX_INPUT
    want, _ = _openai(sdk, [_ids(backend, "short"), _ids(backend, LONG)[:MAX_INPUT]])
    assert np.abs(np.array(cut.embeddings) - want).max() <= 1e-6
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model=MODEL, input=["short", LONG], truncate=False)
    assert refused.value.status_code == 400
    assert "input[1]" in refused.value.error and "255 tokens" in refused.value.error


def _ids(backend: NativeEmbeddingBackend, text: str) -> list[int]:  # noqa: F811
    assert backend.engine is not None
    return list(backend.engine.tokenizer.encode(text))


def test_the_task_is_refused_both_ways(client: ollama.Client, url: str, key: str) -> None:
    with pytest.raises(ollama.ResponseError) as generation:
        client.embed(model=CHAT, input="hello")
    assert generation.value.status_code == 400
    assert f'model "{CHAT}" is not an embedding model' in generation.value.error
    with pytest.raises(ollama.ResponseError) as chat:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert chat.value.status_code == 400 and "is an embedding model" in chat.value.error
    answer = httpx.post(f"{url}/api/generate", json={"model": MODEL, "prompt": "hi"},
                        headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert answer.status_code == 400 and set(answer.json()) == {"error"}


def test_capabilities_show_an_embedding_model(client: ollama.Client, url: str,
                                              key: str) -> None:
    assert client.show(MODEL).capabilities == ["embedding"]
    assert "embedding" not in (client.show(CHAT).capabilities or [])
    tags = httpx.get(f"{url}/api/tags", headers={"Authorization": f"Bearer {key}"},
                     timeout=10).json()["models"]
    assert {m["name"]: m["capabilities"] for m in tags}[f"{MODEL}:latest"] == ["embedding"]


def test_the_key_is_charged_the_inputs_tokens(url: str) -> None:
    key = _key(url)
    client = _ollama(url, key)
    first = client.embed(model=MODEL, input=TEXTS)
    second = client.embed(model=MODEL, input=LONG)
    assert client.embed(model=MODEL, input=[]).embeddings == []  # loads: nothing charged
    usage = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"},
                      timeout=10).json()
    (row,) = usage["data"]
    assert row["requests"] == 2 and row["completion_tokens"] == 0
    assert row["prompt_tokens"] == first.prompt_eval_count + second.prompt_eval_count
