"""Llama 3.2's shape (tied embeddings, `llama3` RoPE scaling, rope_theta 500000) in the native
engine: greedy parity with transformers in float32, alone and batched, on the compiled path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from backends.native.models.llama import LlamaForCausalLM
from tests.native.models.tiny import TINY, VOCAB, write_tiny
from tests.native.test_parity import (
    GREEDY,
    NEW_TOKENS,
    assert_all_blocks_free,
    make_engine,
    reference_greedy,
)

LENGTHS = (3, 17, 40, 9, 25, 61)
# Llama 3.2 1B's scaling, but an original context of 64 (not 8192), so that the tiny model's
# frequencies fall in all three bands: kept, interpolated and divided by the factor.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=True, rope_theta=500000.0,
                                      rope_scaling=LLAMA3_ROPE)
    return write_tiny(tmp_path_factory.mktemp("llama32"), tokenizer_dir, config)


def test_alone_and_batched_match_transformers(folder: Path) -> None:
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    expected = reference_greedy(folder, prompts, NEW_TOKENS)
    engine = make_engine(folder)
    model = engine.loaded.model
    assert type(model) is LlamaForCausalLM and model.tie_word_embeddings
    assert engine.loaded.hf_config.rope_parameters["rope_type"] == "llama3"
    (alone,) = engine.generate(prompts[2:3], GREEDY)
    assert alone.output_token_ids == expected[2]
    assert [s.output_token_ids for s in engine.generate(prompts, GREEDY)] == expected
    assert_all_blocks_free(engine)
    step = engine.runner.decode_step
    assert step is not None and not step.broken and step.num_graphs == 6
