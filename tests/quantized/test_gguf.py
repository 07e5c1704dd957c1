"""GGUF kept quantized: Q4_0 / Q4_1 / Q8_0 / Q4_K blocks against the gguf package's own
dequantization (per tensor, and whole models against `--quantize none`), and the default
model (Q4_1 + a Q8_0 tied embedding) kept vs dequantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from backends.quantized.embedding import PackedEmbedding
from backends.quantized.gguf import GGUFRaw, affine
from backends.quantized.int4_linear import Int4Linear
from backends.quantized.linear import DenseLinear, ShardedLinear
from tests.quantized.gguf_files import blocks, write_tiny_gguf
from tests.quantized.helpers import assert_close_greedy, make_engine, native_greedy

T = GGMLQuantizationType
KEPT = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K]
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def _raw(values: np.ndarray, qtype: GGMLQuantizationType) -> GGUFRaw:
    data = torch.from_numpy(blocks(values, qtype, np.random.default_rng(2)))
    return GGUFRaw("t", qtype, data, values.shape[1])


@pytest.mark.parametrize("qtype", KEPT, ids=lambda t: t.name)
def test_blocks_decode_exactly_as_gguf_dequantizes(qtype: GGMLQuantizationType) -> None:
    values = np.random.default_rng(0).normal(0, 0.1, (64, 512)).astype(np.float32)
    raw = _raw(values, qtype)
    want = torch.from_numpy(dequantize(raw.data.numpy(), qtype).reshape(64, 512).copy())
    torch.testing.assert_close(affine(raw).dense(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype", KEPT, ids=lambda t: t.name)
def test_int4_kernel_matches_dequantized_matmul(qtype: GGMLQuantizationType) -> None:
    values = np.random.default_rng(1).normal(0, 0.1, (128, 256)).astype(np.float32)
    raw = _raw(values, qtype)
    module = Int4Linear(affine(raw), None, torch.device("cpu"), torch.float32)
    x = torch.randn(5, 256)
    want = x @ raw.dense().t()
    torch.testing.assert_close(module(x), want, rtol=1e-4, atol=1e-4)  # int4 kernel
    x = torch.randn(40, 256)
    torch.testing.assert_close(module(x), x @ raw.dense().t(), rtol=1e-4, atol=1e-4)  # dense


MIXED = {"attn_v": T.Q5_1, "ffn_down": T.Q8_0, "attn_output": T.F16}
# Whole files (each engine load converts the 49k-token GGUF tokenizer, ~9 s): Q4_0 alone,
# and a mixed one with Q4_K, Q8_0, Q5_1 and F16 Linears. Every file ties a Q8_0 token_embd
# (packed lm_head + packed embedding); Q4_1 whole-model is the default model test below.
FILES = {
    "Q4_0": lambda stem: T.Q4_0,
    "mixed": lambda stem: MIXED.get(stem, T.Q4_K),  # like llama.cpp's Q4_K_M files
}


@pytest.fixture(scope="module", params=sorted(FILES))
def tiny_gguf(request, tmp_path_factory, default_gguf_path: str) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    return request.param, write_tiny_gguf(path, default_gguf_path, FILES[request.param])


def test_kept_quantized_matches_gguf_dequantization(tiny_gguf) -> None:
    """In float32 the packed kernels must give the dequantized model's logits (the gguf
    package's values) to float rounding; bf16 would only compare two roundings of them."""
    name, path = tiny_gguf
    dense = make_engine(path, quantize="none", dtype="float32")
    prompt = torch.randint(3, 49152, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    want = native_greedy(dense, prompt)
    kept = make_engine(path, dtype="float32")
    assert kept.loaded.quantization.startswith("gguf")
    assert_close_greedy(*native_greedy(kept, prompt), *want, tolerance=1e-3)
    assert kept.loaded.weight_bytes < dense.loaded.weight_bytes
    attn = kept.loaded.model.model.layers[0].self_attn
    if name == "mixed":  # q / k Q4_K packed, v Q5_1 dequantized: separate shards
        assert isinstance(attn.qkv_proj, ShardedLinear)
        assert isinstance(attn.o_proj, DenseLinear)
    else:
        assert isinstance(attn.qkv_proj, Int4Linear)
    # the tied Q8_0 token_embd: one packed copy serves the lm_head and the lookups
    assert isinstance(kept.loaded.model.lm_head, Int4Linear)
    assert isinstance(kept.loaded.model.model.embed_tokens, PackedEmbedding)


def test_default_model_kept_quantized_matches_dequantized() -> None:
    """float32: packed kernels == gguf's dequantized weights (to float rounding); bf16: the
    same greedy tokens, in 0.4x the memory of the dequantized bf16 model."""
    dense = make_engine("default", max_total_tokens=256, dtype="float32", quantize="none")
    prompt = dense.tokenizer.encode_chat(PROMPT)
    want_tokens, want_logits = native_greedy(dense, prompt)
    dense_bf16_bytes = dense.loaded.weight_bytes // 2
    del dense
    kept32 = make_engine("default", max_total_tokens=256, dtype="float32")
    assert_close_greedy(*native_greedy(kept32, prompt), want_tokens, want_logits,
                        tolerance=1e-3)
    del kept32
    kept = make_engine("default", max_total_tokens=256)
    tokens, _ = native_greedy(kept, prompt)
    assert tokens == want_tokens
    assert kept.loaded.quantization == "gguf (kept quantized)"
    assert kept.loaded.weight_bytes <= 0.4 * dense_bf16_bytes
