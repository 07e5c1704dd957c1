"""The native engine's embeddings behind a real uvicorn server, through the real openai SDK.

A tiny random Qwen3-Embedding-shaped decoder (tests/embedding_models.py), served with the
engine's defaults (compiled attention, warm-up, chunked prefill): a batch of inputs of
different lengths in one request, float and base64, must equal transformers' own forward of
each input alone (last token, normalised) within 1e-4 cosine distance; `dimensions` cuts and
renormalises; chat on it is a 400 naming its task.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from backends.native.config import EngineConfig
from backends.native.embedding_backend import NativeEmbeddingBackend
from gateway.app import create_app
from gateway.settings import Settings
from tests.embedding_models import (
    TEXTS,
    cosine_distances,
    decoder_reference,
    write_decoder_embedder,
)
from tests.gateway.conftest import running_server

MODEL = "tiny-embedder"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return write_decoder_embedder(tmp_path_factory.mktemp("embedder"), tokenizer_dir)


@pytest.fixture(scope="module")
def backend(folder: Path) -> NativeEmbeddingBackend:
    return NativeEmbeddingBackend(EngineConfig(
        model=str(folder), served_model_name=MODEL, task="embed", dtype="float32",
        max_total_tokens=256, max_batch_total_tokens=2048, block_size=8,
        max_batch_prefill_tokens=16))


@pytest.fixture(scope="module")
def client(backend: NativeEmbeddingBackend) -> Iterator[openai.OpenAI]:
    app = create_app(Settings(model_id="unused"), backends={MODEL: backend})
    with running_server(app, timeout_s=300) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(folder: Path) -> np.ndarray:
    return decoder_reference(folder, TEXTS)


def _vector(embedding: list[float] | str) -> np.ndarray:
    if isinstance(embedding, str):  # base64 asked by the caller: the SDK leaves it as is
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.array(embedding)


# The SDK asks for base64 when no format is given, and decodes it itself.
@pytest.mark.parametrize("encoding", [openai.NOT_GIVEN, "float", "base64"],
                         ids=["sdk-default", "float", "base64"])
def test_a_batch_of_different_lengths_equals_transformers(
        client: openai.OpenAI, reference: np.ndarray, backend: NativeEmbeddingBackend,
        encoding: object) -> None:
    out = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format=encoding)
    got = np.stack([_vector(item.embedding) for item in out.data])
    assert [item.index for item in out.data] == list(range(len(TEXTS)))
    assert cosine_distances(got, reference).max() < TOLERANCE
    tokenizer = backend.engine.tokenizer  # type: ignore[union-attr]
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    engine = backend.engine
    assert engine is not None and engine.block_manager.num_used_blocks == 0


def test_one_at_a_time_equals_the_batch(client: openai.OpenAI, reference: np.ndarray) -> None:
    for text, want in zip(TEXTS, reference, strict=True):
        got = client.embeddings.create(model=MODEL, input=text).data[0].embedding
        assert cosine_distances(np.array([got]), want[None]).max() < TOLERANCE


def test_dimensions(client: openai.OpenAI, reference: np.ndarray) -> None:
    out = client.embeddings.create(model=MODEL, input=TEXTS[1], dimensions=8)
    got = np.array(out.data[0].embedding)
    want = reference[1][:8] / np.linalg.norm(reference[1][:8])
    assert got.shape == (8,) and cosine_distances(got[None], want[None]).max() < TOLERANCE
    with pytest.raises(openai.BadRequestError, match="at most 64"):
        client.embeddings.create(model=MODEL, input="x", dimensions=65)


def test_too_long_an_input_names_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input=["short", "word " * 300])
    assert caught.value.body["param"] == "input[1]"
    assert "maximum input of 255 tokens" in caught.value.body["message"]


def test_chat_is_refused_naming_the_task(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="task: embed"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    cards = {card.id: card for card in client.models.list().data}
    assert cards[MODEL].model_extra["task"] == "embed"
