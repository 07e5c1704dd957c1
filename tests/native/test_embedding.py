"""The native engine's embeddings against transformers' own forward of the same decoder.

A tiny random `Qwen3Model` saved as Qwen3-Embedding is (bare decoder, no lm_head): the engine
loads it without an lm_head and runs each input as a prompt-only sequence through the
scheduler, paged KV cache and batching. Inputs of different lengths, batched together, whole
or in chunks, recomputed after a failed step and through the prefix cache, must each give the
vector transformers gives that input alone, within 1e-4 cosine distance; a wrong pooling is
far outside that.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from backends.native.config import EngineConfig
from backends.native.llm_engine import LLMEngine
from backends.pooling import PoolingConfigError
from tests.embedding_models import (
    TEXTS,
    cosine_distances,
    decoder_reference,
    write_decoder_embedder,
    write_st_pooling,
)

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return write_decoder_embedder(tmp_path_factory.mktemp("qwen3-embedder"), tokenizer_dir)


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path,
           ) -> Callable[[str], Path]:
    """The same weights with a sentence-transformers config asking for `mode`."""
    made: dict[str, Path] = {}

    def make(mode: str) -> Path:
        if mode not in made:
            made[mode] = write_decoder_embedder(tmp_path_factory.mktemp(f"pooled-{mode}"),
                                                tokenizer_dir, pooling=mode)
        return made[mode]
    return make


def _engine(folder: Path, **options: object) -> LLMEngine:
    settings = {"dtype": "float32", "max_total_tokens": 256, "max_batch_total_tokens": 2048,
                "block_size": 8, "compile": False, **options}
    return LLMEngine(EngineConfig(model=str(folder), task="embed", **settings))


def _embed(engine: LLMEngine, folder: Path, texts: list[str], tag: str = "r") -> np.ndarray:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine.add_embedding(tag, [tokenizer(t).input_ids for t in texts])
    outputs = []
    while engine.has_work():
        outputs.extend(engine.step())
    assert all(o.finish_reason == "stop" for o in outputs)
    vectors = {o.index: o.embedding for o in outputs}
    return np.stack([vectors[i] for i in range(len(texts))])


def _idle(engine: LLMEngine) -> None:
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("options", [
    {},  # the inputs batched, each prompt whole
    {"max_batch_prefill_tokens": 8},  # in chunks of 8, beside each other
    {"chunked_prefill": False},  # TGI's whole prompts
], ids=["batched", "chunked", "unchunked"])
def test_last_token_vectors_equal_transformers(embedder: Path, options: dict) -> None:
    engine = _engine(embedder, **options)
    got = _embed(engine, embedder, TEXTS)
    assert got.shape == (len(TEXTS), 64) and got.dtype == np.float32
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert cosine_distances(got, decoder_reference(embedder, TEXTS)).max() < TOLERANCE
    _idle(engine)  # every block went back once the vectors were out


@pytest.mark.parametrize("mode", ["mean", "last"])
def test_a_failed_step_is_recomputed_and_fails_only_its_request(
        pooled: Callable[[str], Path], mode: str) -> None:
    """A step holding a faulty request is undone and its sequences rerun alone: the other
    request's pooling starts over from position 0 and still equals the reference."""
    folder = pooled(mode)
    engine = _engine(folder, max_batch_prefill_tokens=16,
                     fault_request_ids=frozenset({"bad"}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine.add_embedding("good", [tokenizer(t).input_ids for t in TEXTS])
    engine.add_embedding("bad", [tokenizer(TEXTS[2]).input_ids])
    outputs = []
    while engine.has_work():
        outputs.extend(engine.step())
    good = {o.index: o.embedding for o in outputs if o.request_id == "good"}
    got = np.stack([good[i] for i in range(len(TEXTS))])
    assert cosine_distances(got, decoder_reference(folder, TEXTS, mode)).max() < TOLERANCE
    assert [o.finish_reason for o in outputs if o.request_id == "bad"] == ["error"]
    assert engine.num_step_failures > 0
    _idle(engine)


def test_the_prefix_cache_serves_a_repeated_input(embedder: Path) -> None:
    engine = _engine(embedder)
    first = _embed(engine, embedder, TEXTS, "first")
    hits = engine.block_manager.hits
    again = _embed(engine, embedder, TEXTS, "again")
    assert engine.block_manager.hits > hits
    assert cosine_distances(first, again).max() < TOLERANCE
    _idle(engine)


@pytest.mark.parametrize("mode", ["mean", "cls", "last"])
def test_the_sentence_transformers_pooling_is_followed(pooled: Callable[[str], Path],
                                                        mode: str) -> None:
    folder = pooled(mode)
    engine = _engine(folder, max_batch_prefill_tokens=8)  # mean sums over the chunks
    got = _embed(engine, folder, TEXTS)
    assert cosine_distances(got, decoder_reference(folder, TEXTS, mode)).max() < TOLERANCE
    hits = engine.block_manager.hits
    _embed(engine, folder, TEXTS, "again")  # mean and cls need every position computed
    assert (engine.block_manager.hits > hits) == (mode == "last")


def test_a_wrong_pooling_is_caught(embedder: Path) -> None:
    """The comparison above can fail: the mean of the same states is far from the last."""
    got = _embed(_engine(embedder), embedder, TEXTS)
    mean = decoder_reference(embedder, TEXTS, "mean")
    assert cosine_distances(got, mean)[1:].min() > 100 * TOLERANCE  # "Hi": one token


def test_unnormalised_pooling_is_kept(tmp_path: Path, embedder: Path) -> None:
    for item in embedder.iterdir():
        if item.is_file():
            (tmp_path / item.name).write_bytes(item.read_bytes())
    write_st_pooling(tmp_path, "last", normalize=False, size=64)
    got = _embed(_engine(tmp_path), tmp_path, TEXTS)
    want = decoder_reference(tmp_path, TEXTS, normalize=False)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1),
                               rtol=1e-4)


def test_an_unsupported_pooling_is_refused_at_load(tmp_path: Path, embedder: Path) -> None:
    for item in embedder.iterdir():
        if item.is_file():
            (tmp_path / item.name).write_bytes(item.read_bytes())
    write_st_pooling(tmp_path, "max", normalize=True, size=64)
    with pytest.raises(PoolingConfigError, match="not supported"):
        _engine(tmp_path)
