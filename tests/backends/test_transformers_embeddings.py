"""Encoder embedding models on the transformers backend, against sentence-transformers itself.

Tiny random BertModel / XLMRobertaModel folders saved by sentence-transformers (CLS or mean
pooling, with or without Normalize), declared in a models file with `task: embed` and served
by a real uvicorn server: the real openai SDK's vectors for a batch of inputs of different
lengths must equal `SentenceTransformer.encode`'s within 1e-4 cosine distance. The same
comparison fails for a model whose pooling differs from the reference's.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import yaml
from transformers import AutoTokenizer

from gateway.app import create_app
from gateway.settings import Settings
from tests.embedding_models import TEXTS, cosine_distances, encoder_reference, write_encoder
from tests.gateway.conftest import running_server

TOLERANCE = 1e-4
# name -> (architecture, pooling, Normalize module)
MODELS = {
    "bert-cls": ("bert", "cls", True),
    "bert-mean": ("bert", "mean", True),
    "xlmr-mean": ("xlm-roberta", "mean", True),
    "bert-mean-raw": ("bert", "mean", False),
}
ENCODER_TEXTS = [t.lower() for t in TEXTS]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: write_encoder(tmp_path_factory.mktemp(name), kind, pooling, normalize)
            for name, (kind, pooling, normalize) in MODELS.items()}


@pytest.fixture(scope="module")
def url(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    models = [{"name": name, "model_id": str(folder), "backend": "transformers",
               "task": "embed", "options": {"dtype": "float32"}}
              for name, folder in folders.items()]
    config = tmp_path_factory.mktemp("config") / "models.yaml"
    config.write_text(yaml.safe_dump({"models": models}))
    with running_server(create_app(Settings(config_file=config)), timeout_s=120) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("name", list(MODELS))
def test_vectors_equal_sentence_transformers(client: openai.OpenAI, folders: dict[str, Path],
                                             name: str) -> None:
    out = client.embeddings.create(model=name, input=ENCODER_TEXTS)  # the SDK's base64
    got = np.array([item.embedding for item in out.data])
    want = encoder_reference(folders[name], ENCODER_TEXTS)
    assert cosine_distances(got, want).max() < TOLERANCE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1),
                               rtol=1e-4)  # normalised exactly when the config says so


def test_a_wrong_pooling_is_caught(client: openai.OpenAI, folders: dict[str, Path]) -> None:
    """The comparison can fail: CLS vectors are far from the mean-pooled reference."""
    out = client.embeddings.create(model="bert-cls", input=ENCODER_TEXTS)
    got = np.array([item.embedding for item in out.data])
    mean = encoder_reference(folders["bert-mean"], ENCODER_TEXTS)  # the same weights
    assert cosine_distances(got, mean).min() > 100 * TOLERANCE


def test_token_ids_and_float_and_dimensions(url: str, folders: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(folders["bert-mean"])
    ids = [tokenizer(t).input_ids for t in ENCODER_TEXTS[:2]]
    body = {"model": "bert-mean", "input": ids, "encoding_format": "float"}
    answer = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60).json()
    got = np.array([item["embedding"] for item in answer["data"]])
    want = encoder_reference(folders["bert-mean"], ENCODER_TEXTS[:2])
    assert cosine_distances(got, want).max() < TOLERANCE
    assert answer["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    body = {"model": "bert-mean", "input": ENCODER_TEXTS[1], "dimensions": 8,
            "encoding_format": "base64"}
    data = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60).json()["data"]
    short = np.frombuffer(base64.b64decode(data[0]["embedding"]), dtype="<f4")
    assert short.shape == (8,)
    assert cosine_distances(short[None], want[1:2, :8]).max() < TOLERANCE


def test_unnormalised_models_refuse_dimensions_and_long_inputs_are_named(
        client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="does not normalise"):
        client.embeddings.create(model="bert-mean-raw", input="a cat", dimensions=4)
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="bert-cls", input=["a cat", "cat " * 200])
    assert caught.value.body["param"] == "input[1]"


def test_info_reports_the_pooling(url: str) -> None:
    info = httpx.get(f"{url}/info", headers={"x-model": "xlmr-mean"}, timeout=10).json()
    assert info["task"] == "embed" and info["architecture"] == "XLMRobertaModel"
    assert info["pooling"] == {"mode": "mean", "normalize": True, "source": "modules.json"}
