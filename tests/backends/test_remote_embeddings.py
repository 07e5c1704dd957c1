"""Remote deployments of an embedding model: /v1/embeddings passed through to a stand-in
OpenAI-compatible upstream (embedding_stub.py) on a real port, through a real gateway, with
the real openai SDK; its refusals pass through, its failures fall back to the next deployment,
and an answer that does not add up is a 502."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import yaml

from gateway.app import create_app
from gateway.settings import Settings
from tests.backends.embedding_stub import EmbeddingStub, create_embedding_stub, stub_vector
from tests.gateway.conftest import running_server

MODEL = "remote-embedder"
TEXTS = ["a brave little toaster", "hello", "the quick brown fox"]


@pytest.fixture(scope="module")
def stubs() -> Iterator[tuple[EmbeddingStub, EmbeddingStub, str, str]]:
    first, second = EmbeddingStub(), EmbeddingStub()
    with running_server(create_embedding_stub(first)) as a, \
            running_server(create_embedding_stub(second)) as b:
        yield first, second, a, b


@pytest.fixture(scope="module")
def url(stubs: tuple[EmbeddingStub, EmbeddingStub, str, str],
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _, _, a, b = stubs
    deployments = [{"backend": "remote", "name": name, "base_url": f"{base}/v1",
                    "model": "stub-embedder", "priority": priority}
                   for name, base, priority in (("first", a, 0), ("second", b, 1))]
    config: Path = tmp_path_factory.mktemp("remote") / "models.yaml"
    config.write_text(yaml.safe_dump({  # failures never take `first` out of rotation here
        "routing": {"cooldown_after_failures": 1000},
        "models": [{"name": MODEL, "task": "embed", "deployments": deployments}]}))
    with running_server(create_app(Settings(config_file=config))) as base:
        yield base


@pytest.fixture
def stub(stubs: tuple[EmbeddingStub, EmbeddingStub, str, str]) -> Iterator[EmbeddingStub]:
    first, second, _, _ = stubs
    yield first
    first.mode = second.mode = "ok"
    first.requests.clear()
    second.requests.clear()


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_passed_through_in_order(client: openai.OpenAI, stub: EmbeddingStub) -> None:
    out = client.embeddings.create(model=MODEL, input=TEXTS, user="u-1")  # the SDK's base64
    for text, item in zip(TEXTS, out.data, strict=True):
        np.testing.assert_array_equal(item.embedding, stub_vector(text))
    assert out.model == MODEL and out.usage.prompt_tokens == 33  # the upstream's count
    sent = stub.requests[-1]
    assert sent["model"] == "stub-embedder" and sent["input"] == TEXTS
    assert sent["encoding_format"] == "float" and sent["user"] == "u-1"


def test_dimensions_and_token_ids_go_upstream(client: openai.OpenAI,
                                              stub: EmbeddingStub) -> None:
    out = client.embeddings.create(model=MODEL, input=[[5, 6, 7]], dimensions=4,
                                   encoding_format="float")
    np.testing.assert_allclose(out.data[0].embedding, stub_vector([5, 6, 7], 4), atol=1e-7)
    assert stub.requests[-1]["dimensions"] == 4 and stub.requests[-1]["input"] == [[5, 6, 7]]


def test_an_upstream_refusal_passes_through(client: openai.OpenAI, stub: EmbeddingStub) -> None:
    stub.mode = "status:400"
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input="hello", dimensions=99)
    assert caught.value.body["message"] == "stub says 400"
    assert caught.value.body["param"] == "dimensions"


@pytest.mark.parametrize("mode", ["status:500", "malformed", "nan"])
def test_a_failing_upstream_falls_back(client: openai.OpenAI, stub: EmbeddingStub,
                                       stubs: tuple[EmbeddingStub, ...], mode: str) -> None:
    stub.mode = mode
    out = client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    np.testing.assert_allclose(out.data[1].embedding, stub_vector(TEXTS[1]), atol=1e-7)
    assert len(stubs[0].requests) == 1 and len(stubs[1].requests) == 1


def test_both_failing_is_a_502(url: str, stubs: tuple[EmbeddingStub, ...],
                               stub: EmbeddingStub) -> None:
    stubs[0].mode = stubs[1].mode = "malformed"
    answer = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "hi"},
                        timeout=10)
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_malformed"


@pytest.mark.parametrize("mode", ["base64", "no_usage"])
def test_base64_answers_and_missing_usage(client: openai.OpenAI, stub: EmbeddingStub,
                                          mode: str) -> None:
    stub.mode = mode
    out = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    np.testing.assert_array_equal(out.data[2].embedding, stub_vector(TEXTS[2]))
    assert len(stub.requests) == 1  # `first` answered
    if mode == "no_usage":  # counted here, erring high without a tokenizer
        assert out.usage.prompt_tokens >= sum(len(t.split()) for t in TEXTS)
