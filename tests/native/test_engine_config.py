"""Startup refuses settings that cannot work, with messages naming the flags."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from backends.native.loading.model_setup import EngineConfigError
from tests.native.test_parity import make_engine


def test_kv_cache_too_small_for_one_request(tiny_model: Callable[[str], Path]) -> None:
    with pytest.raises(EngineConfigError, match="--max-total-tokens=256"):
        make_engine(tiny_model("llama_gqa"), max_batch_total_tokens=100)
    with pytest.raises(EngineConfigError, match="--kv-cache-memory"):
        make_engine(tiny_model("llama_gqa"), max_batch_total_tokens=None, kv_cache_memory=4096)


def test_kv_cache_sized_from_a_memory_budget(tiny_model: Callable[[str], Path]) -> None:
    engine = make_engine(tiny_model("llama_gqa"), max_batch_total_tokens=None,
                         kv_cache_memory=8 * 2**20, block_size=16)
    per_token = 2 * 2 * 2 * 16 * 4  # k+v, 2 layers, 2 kv heads, head_dim 16, float32
    assert engine.block_manager.num_blocks == 8 * 2**20 // per_token // 16


def test_limits_beyond_the_model_are_refused(tiny_model: Callable[[str], Path]) -> None:
    with pytest.raises(EngineConfigError, match="context window"):
        make_engine(tiny_model("llama_gqa"), max_total_tokens=100_000)
    with pytest.raises(EngineConfigError, match="--max-input-tokens"):
        make_engine(tiny_model("llama_gqa"), max_input_tokens=256)
    with pytest.raises(EngineConfigError, match="--max-batch-prefill-tokens"):
        make_engine(tiny_model("llama_gqa"), chunked_prefill=False, max_batch_prefill_tokens=64)


def test_prefill_budget_defaults_by_device_and_chunking() -> None:
    """Unset, a CPU engine with chunked prefill takes 512 prompt tokens a step; unchunked
    or on a GPU, TGI's 4096; a value set is kept."""
    from backends.native.config import EngineConfig

    assert EngineConfig(model="m").max_batch_prefill_tokens == 512
    assert EngineConfig(model="m", chunked_prefill=False).max_batch_prefill_tokens == 4096
    assert EngineConfig(model="m", device="cuda").max_batch_prefill_tokens == 4096
    assert EngineConfig(model="m", max_batch_prefill_tokens=300).max_batch_prefill_tokens == 300
    assert EngineConfig(model="m", max_batch_prefill_tokens=None).max_batch_prefill_tokens == 512
