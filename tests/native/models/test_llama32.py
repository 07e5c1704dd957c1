"""Llama 3.2's shape (tied embeddings, `llama3` RoPE scaling, rope_theta 500000) in the native
engine: greedy parity with transformers in float32, alone and batched, on the compiled path;
and from a GGUF file as llama.cpp's converter writes it (the scaling as a `rope_freqs` tensor
of per-frequency factors, no metadata), past the original context where the scaling shows."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from backends.native.loading.gguf_rope import llama3_rope_scaling
from backends.native.models.llama import LlamaForCausalLM
from tests.native.models.tiny import TINY, VOCAB, gguf_writer, write_tiny
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


def llama32_config(**overrides: object) -> transformers.LlamaConfig:
    options = {**TINY, "tie_word_embeddings": True, "rope_theta": 500000.0,
               "rope_scaling": LLAMA3_ROPE, **overrides}
    return transformers.LlamaConfig(**options)


def _sharper_attention(name: str, param: torch.nn.Parameter) -> None:
    """q / k x4: a random tiny model's attention is nearly uniform, blind to positions (and so
    to their rotary); sharper, plain RoPE picks other tokens past the original context."""
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        param.mul_(4.0)


def converter_rope_factors(rope: dict[str, float], theta: float, dim: int) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors: one factor a rotary frequency, float32."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q / k row order for its interleaved rotary."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_llama32_gguf(path: Path, folder: Path, tokenizer_gguf: str) -> Path:
    """`folder`'s weights as llama.cpp's converter writes a Llama 3.2: q / k rows permuted,
    no output.weight (tied), and `rope_freqs.weight` for the llama3 scaling."""
    config = transformers.AutoConfig.from_pretrained(folder)
    head_dim = config.hidden_size // config.num_attention_heads
    writer = gguf_writer(path, gguf.MODEL_ARCH.LLAMA, config, tokenizer_gguf)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    rope = config.rope_parameters
    writer.add_tensor("rope_freqs.weight",
                      converter_rope_factors(rope, rope["rope_theta"], head_dim))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        if name.endswith("q_proj.weight"):
            tensor = _permute(tensor, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            tensor = _permute(tensor, config.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return write_tiny(tmp_path_factory.mktemp("llama32"), tokenizer_dir, llama32_config(),
                      tweak=_sharper_attention)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def expected(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    return reference_greedy(folder, prompts, NEW_TOKENS)


def test_alone_and_batched_match_transformers(
    folder: Path, prompts: list[list[int]], expected: list[list[int]],
) -> None:
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


def test_gguf_with_rope_freqs_matches_transformers(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, folder: Path,
    default_gguf_path: str, prompts: list[list[int]], expected: list[list[int]],
) -> None:
    """Eager: only the loading differs from the folder's. The longest prompts run past the
    original context (64), where plain RoPE picks other tokens (checked: the scaling shows)."""
    path = write_llama32_gguf(tmp_path_factory.mktemp("llama32-gguf") / "tiny-llama32.gguf",
                              folder, default_gguf_path)
    engine = make_engine(path, compile=False)
    config = engine.loaded.hf_config
    assert config.model_type == "llama" and config.tie_word_embeddings
    assert [s.output_token_ids for s in engine.generate(prompts, GREEDY)] == expected
    assert config.rope_parameters["rope_type"] == "llama3"
    assert_all_blocks_free(engine)
    plain = write_tiny(tmp_path_factory.mktemp("llama32-plain"), tokenizer_dir,
                       llama32_config(rope_scaling=None), tweak=_sharper_attention)
    assert reference_greedy(plain, prompts, NEW_TOKENS) != expected


@pytest.mark.parametrize(("theta", "dim", "rope"), [
    (500000.0, 64, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}),  # Llama 3.2 1B / 3B
    (500000.0, 128, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}),  # Llama 3.1 8B
    (500000.0, 16, LLAMA3_ROPE),  # one interpolated frequency only: band edges picked
])
def test_rope_freqs_give_the_llama3_frequencies(
    theta: float, dim: int, rope: dict[str, float],
) -> None:
    factors = torch.from_numpy(converter_rope_factors(rope, theta, dim))
    scaling = llama3_rope_scaling(factors, theta, dim, 131072)
    assert scaling is not None and scaling["factor"] == rope["factor"]
    if dim > 16:  # two or more interpolated: the checkpoint's own parameters come back
        assert scaling["high_freq_factor"] == 4.0
        assert scaling["original_max_position_embeddings"] == 8192
    config = transformers.LlamaConfig(head_dim=dim, hidden_size=dim, num_attention_heads=1,
                                      rope_theta=theta, rope_scaling=scaling)
    got, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    torch.testing.assert_close(got.double(), base / factors.double(), rtol=1e-6, atol=0)
    assert llama3_rope_scaling(torch.ones(dim // 2), theta, dim, 131072) is None
