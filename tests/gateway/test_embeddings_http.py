"""POST /v1/embeddings through a real uvicorn server with the real openai SDK: shapes,
encodings, `dimensions`, bounds, wrong endpoints both ways, fallbacks, /v1/models, /info and
/metrics. The model is a deterministic stand-in (echo_embedding.py); the engines' vectors are
checked against their references in tests/native and tests/backends."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from routing.deployment import Deployment
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend
from tests.gateway.echo_embedding import EchoEmbeddingBackend, vector_of, words

EMBED, RAW, CHAT, SPARE = "echo-embed", "raw-embed", "echo", "spare-embed"
MAX_INPUTS = 4


@pytest.fixture(scope="module")
def spare() -> tuple[EchoEmbeddingBackend, EchoEmbeddingBackend]:
    return EchoEmbeddingBackend(name="down", down=True), EchoEmbeddingBackend(name="up")


@pytest.fixture(scope="module")
def url(spare: tuple[EchoEmbeddingBackend, EchoEmbeddingBackend]) -> Iterator[str]:
    down, up = spare
    backends = {
        EMBED: EchoEmbeddingBackend(), RAW: EchoEmbeddingBackend(name=RAW, normalized=False),
        CHAT: EchoBackend(name=CHAT),
        SPARE: [Deployment("down", down), Deployment("up", up, priority=1)],
    }
    settings = Settings(model_id="unused", max_embedding_inputs=MAX_INPUTS)
    with running_server(create_app(settings, backends=backends)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)


def expected(text: str, size: int = 16) -> np.ndarray:
    return vector_of(words(text, 1000), size, True)


TEXTS = ["a brave little toaster", "hello", "the quick brown fox jumps"]


def test_the_sdk_gets_one_vector_per_input_in_order(client: openai.OpenAI) -> None:
    # The SDK asks for base64 unless told otherwise, and decodes it.
    for encoding in (openai.NOT_GIVEN, "float"):
        out = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format=encoding)
        assert out.object == "list" and out.model == EMBED
        assert [d.index for d in out.data] == [0, 1, 2]
        for text, item in zip(TEXTS, out.data, strict=True):
            assert item.object == "embedding"
            np.testing.assert_allclose(item.embedding, expected(text), rtol=0, atol=1e-7)
        tokens = sum(len(t.split()) for t in TEXTS)
        assert (out.usage.prompt_tokens, out.usage.total_tokens) == (tokens, tokens)


def test_base64_is_little_endian_float32(url: str) -> None:
    body = {"model": EMBED, "input": "hello world", "encoding_format": "base64"}
    data = httpx.post(f"{url}/v1/embeddings", json=body, timeout=10).json()["data"]
    raw = base64.b64decode(data[0]["embedding"])
    assert np.array_equal(np.frombuffer(raw, dtype="<f4"), expected("hello world"))
    floats = httpx.post(f"{url}/v1/embeddings", json={"model": EMBED, "input": "hello world"},
                        timeout=10).json()["data"][0]["embedding"]
    assert floats == np.frombuffer(raw, dtype="<f4").tolist()  # float is the default


def test_token_ids_are_inputs_as_they_are(client: openai.OpenAI) -> None:
    ids = words("a brave little toaster", 1000)
    one = client.embeddings.create(model=EMBED, input=ids, encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids)
    np.testing.assert_allclose(one.data[0].embedding, expected(TEXTS[0]), atol=1e-7)
    many = client.embeddings.create(model=EMBED, input=[ids, [7]], encoding_format="float")
    np.testing.assert_allclose(many.data[1].embedding, vector_of([7], 16, True), atol=1e-7)


def test_dimensions_keep_the_first_values_renormalised(client: openai.OpenAI) -> None:
    out = client.embeddings.create(model=EMBED, input="hello", dimensions=5)
    got = np.array(out.data[0].embedding)
    full = expected("hello")
    assert got.shape == (5,) and abs(np.linalg.norm(got) - 1) < 1e-6
    np.testing.assert_allclose(got, full[:5] / np.linalg.norm(full[:5]), atol=1e-6)


@pytest.mark.parametrize(("model", "dimensions", "says"), [
    (EMBED, 17, "at most 16"), (RAW, 4, "does not normalise")])
def test_dimensions_the_model_cannot_give_are_a_400(
        client: openai.OpenAI, model: str, dimensions: int, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=model, input="hello", dimensions=dimensions)
    assert caught.value.body["param"] == "dimensions" and says in caught.value.body["message"]


def test_too_many_inputs_and_too_long_an_input_are_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBED, input=["x"] * (MAX_INPUTS + 1))
    assert caught.value.body["code"] == "array_above_max_length"
    assert f"maximum length {MAX_INPUTS}" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBED, input=["fine", "word " * 65])
    assert caught.value.body["param"] == "input[1]"
    assert "65 tokens" in caught.value.body["message"]


@pytest.mark.parametrize(("value", "param"), [
    ("", "input"), (["ok", ""], "input[1]"), ([], "input"), (["a", 1], "input"),
    ([[1, 2], []], "input[1]"), ([-1], "input"), (5, "input"), (None, "input")])
def test_bad_inputs_are_400s_naming_the_input(url: str, value: object, param: str) -> None:
    answer = httpx.post(f"{url}/v1/embeddings", json={"model": EMBED, "input": value},
                        timeout=10)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_generation_routes_refuse_an_embedding_model(client: openai.OpenAI, url: str) -> None:
    for call in (
        lambda: client.chat.completions.create(
            model=EMBED, messages=[{"role": "user", "content": "hi"}]),
        lambda: client.completions.create(model=EMBED, prompt="hi"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        message = caught.value.body["message"]
        assert f"`{EMBED}`" in message and "task: embed" in message
        assert caught.value.body["code"] == "model_task_mismatch"
    tgi = httpx.post(f"{url}/generate", json={"inputs": "hi"}, headers={"x-model": EMBED},
                     timeout=10)
    assert tgi.status_code == 422 and "task: embed" in tgi.json()["error"]


def test_embeddings_refuse_a_generation_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=CHAT, input="hi")
    message = caught.value.body["message"]
    assert f"`{CHAT}`" in message and "task: generate" in message
    assert caught.value.body["param"] == "model"


def test_a_failing_deployment_falls_back(
        client: openai.OpenAI, spare: tuple[EchoEmbeddingBackend, EchoEmbeddingBackend]) -> None:
    down, up = spare
    out = client.embeddings.create(model=SPARE, input="hello", encoding_format="float")
    np.testing.assert_allclose(out.data[0].embedding, expected("hello"), atol=1e-7)
    assert len(down.requests) == 1 and len(up.requests) == 1


def test_a_model_failure_is_a_500(url: str) -> None:
    backend = EchoEmbeddingBackend(fail=True)
    with running_server(create_app(Settings(), backends={EMBED: backend})) as other:
        answer = httpx.post(f"{other}/v1/embeddings", json={"input": "hi"}, timeout=10)
    assert answer.status_code == 500 and answer.json()["error"]["code"] == "embedding_error"


def test_models_info_and_metrics_show_the_task(url: str) -> None:
    cards = {c["id"]: c for c in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    assert cards[EMBED]["task"] == "embed" and cards[CHAT]["task"] == "generate"
    info = httpx.get(f"{url}/info", headers={"x-model": EMBED}, timeout=10).json()
    assert info["task"] == "embed" and info["model_pipeline_tag"] == "feature-extraction"
    assert httpx.get(f"{url}/info", headers={"x-model": CHAT}, timeout=10).json()["task"] == \
        "generate"
    httpx.post(f"{url}/v1/embeddings", json={"model": EMBED, "input": "one two three"},
               timeout=10)
    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert f'tgi_request_success{{model="{EMBED}"}}' in text
    assert f'switchyard_prompt_tokens_total{{model="{EMBED}"}}' in text
    assert (f'switchyard_requests_total{{model="{EMBED}",route="/v1/embeddings",status="200"}}'
            in text)
