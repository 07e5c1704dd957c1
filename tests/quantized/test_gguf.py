"""GGUF kept quantized: Q4_0 / Q4_1 / Q8_0 / Q4_K blocks against the gguf package's own
dequantization (per tensor, and whole models against `--quantize none`), and the default
model (Q4_1 + a Q8_0 tied embedding) kept vs dequantized, here and, in a child process, with
torch's AVX2 int4 packing.

Kept packed, scales and zeros are bf16 and the int4 kernel takes and gives bf16 (fp32 inputs
cost it 15-40x, int4_linear.KERNEL_DTYPE), so even a float32 engine differs from the gguf
package's fp16-scaled values by bf16 roundings; the tolerances below are measured."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from backends.quantized import q8_linear
from backends.quantized.embedding import PackedEmbedding
from backends.quantized.gguf import GGUFRaw, affine, q8_0_values
from backends.quantized.int4_linear import DENSE_MIN_ROWS, Int4Linear
from backends.quantized.linear import DenseLinear, ShardedLinear
from backends.quantized.q8_linear import Q8Linear
from tests.quantized import default_model_check
from tests.quantized.gguf_files import blocks, write_tiny_gguf
from tests.quantized.helpers import (
    dense_linear_bytes,
    has_avx2,
    make_engine,
    native_greedy,
    quantized_linear_bytes,
    run_in_child,
)

T = GGMLQuantizationType
KEPT = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K]
# Max |logit - dense fp32 logit| of the kept default model over default_model_check's 8 steps,
# the same on AVX-512-BF16 and under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2: float32
# 0.42, bf16 0.69 (logits up to ~30); about 1.5x that. Its top-2 margins there are >= 1.27.
DEFAULT_TOLERANCE = {"float32": 0.6, "bfloat16": 1.0}
# The default model kept packed, resident, at most this fraction of its bf16 size (measured
# 0.38 on both instruction sets; 0.59 when the tied embedding was kept dense on AVX2).
DEFAULT_BUDGET = 0.4


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
    """Both paths of a float32 engine against gguf's values: bf16 scales (2^-9 relative) and,
    on the kernel path, bf16 inputs and outputs; measured worst 0.4% of the largest output."""
    values = np.random.default_rng(1).normal(0, 0.1, (128, 256)).astype(np.float32)
    raw = _raw(values, qtype)
    module = Int4Linear(affine(raw), None, torch.device("cpu"), torch.float32)
    for rows in (5, DENSE_MIN_ROWS + 8):  # the int4 kernel, then dequantize + matmul
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        want = x.double() @ raw.dense().double().t()
        diff = (module(x).double() - want).abs().max().item()
        assert diff <= 1e-2 * want.abs().max().item(), (rows, diff)


def test_q8_0_kept_8_bit_matches_gguf_dequantization() -> None:
    """Q8_0 blocks as int8 + scales (our Q8_0 kernel's form) are gguf's values exactly, and
    the kernel's products are within its int16-input error of them."""
    values = np.random.default_rng(3).normal(0, 0.1, (64, 256)).astype(np.float32)
    raw = _raw(values, T.Q8_0)
    q, scale = q8_0_values(raw)
    want = raw.dense()
    assert torch.equal((q.float().view(64, -1, 32) * scale.unsqueeze(-1)).view(64, 256), want)
    if not q8_linear.available(torch.device("cpu"), torch.float32):
        pytest.skip("the Q8_0 kernel runs where our kernels run (AVX2 or AVX-512 VNNI)")
    module = Q8Linear(q, scale, None, torch.device("cpu"), torch.float32)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5))
    reference = x.double() @ want.double().t()
    assert (module(x).double() - reference).abs().max().item() <= \
        5e-4 * reference.abs().max().item()


MIXED = {"attn_v": T.Q5_1, "ffn_down": T.Q8_0, "attn_output": T.F16}
# Whole files (each engine load converts the 49k-token GGUF tokenizer, ~9 s): Q4_0 alone,
# and a mixed one with Q4_K, Q8_0, Q5_1 and F16 Linears. Every file ties a Q8_0 token_embd
# (packed lm_head + packed embedding); Q4_1 whole-model is the default model test below.
FILES = {
    "Q4_0": lambda stem: T.Q4_0,
    "mixed": lambda stem: MIXED.get(stem, T.Q4_K),  # like llama.cpp's Q4_K_M files
}


# Max |logit diff| of the tiny files kept vs dequantized, float32, one step after 3 prompts of
# 12 tokens (int4 kernel) and 2 of 160 (dequantize + matmul): Q4_0 0.020, mixed 0.014 (logits
# up to 1.65), the same on AVX-512 and AVX2; 2.5x that. Their random weights leave greedy
# margins under 0.002, so tokens are not compared over several steps here.
TINY_TOLERANCE = 0.05
# Kept / dequantized bf16 bytes: a Q8_0 tied embedding packed once is 1.25 bytes a weight
# (measured 0.60 and 0.63 in float32); a dense copy beside the packed lm_head: above 1.5.
TINY_BUDGET = 0.7


@pytest.fixture(scope="module", params=sorted(FILES))
def tiny_gguf(request, tmp_path_factory, default_gguf_path: str) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    return request.param, write_tiny_gguf(path, default_gguf_path, FILES[request.param])


def _bf16_bytes(path: Path | str) -> int:
    return 2 * sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors)


def test_kept_quantized_matches_gguf_dequantization(tiny_gguf) -> None:
    """float32: the packed kernels against the dequantized model's logits (the gguf package's
    values), through the int4 kernel (12-token prompt) and dequantize + matmul (160 tokens)."""
    name, path = tiny_gguf
    dense = make_engine(path, quantize="none", dtype="float32", max_total_tokens=256)
    kept = make_engine(path, dtype="float32", max_total_tokens=256)
    assert kept.loaded.quantization.startswith("gguf")
    gen = torch.Generator().manual_seed(0)
    for length in (12, DENSE_MIN_ROWS + 32):
        prompt = torch.randint(3, 49152, (length,), generator=gen).tolist()
        want = native_greedy(dense, prompt, steps=1)[1]
        diff = (native_greedy(kept, prompt, steps=1)[1] - want).abs().max().item()
        assert diff <= TINY_TOLERANCE, (length, diff)
    assert kept.loaded.weight_bytes <= TINY_BUDGET * _bf16_bytes(path)
    if name == "Q4_0":  # every Linear 4-bit: packed nibbles + bf16 scales, 0.31x measured
        ratio = quantized_linear_bytes(kept) / dense_linear_bytes(kept.loaded.hf_config)
        assert ratio <= 0.35, ratio
    attn = kept.loaded.model.model.layers[0].self_attn
    if name == "mixed":  # q / k Q4_K packed, v Q5_1 dequantized: separate shards
        assert isinstance(attn.qkv_proj, ShardedLinear)
        assert isinstance(attn.o_proj, DenseLinear)
    else:
        assert isinstance(attn.qkv_proj, Int4Linear)
    # the tied Q8_0 token_embd: one packed copy serves the lm_head and the lookups, 8-bit
    # where our kernels run, else two int4 halves
    q8 = q8_linear.available(torch.device("cpu"), torch.float32)
    assert isinstance(kept.loaded.model.lm_head, Q8Linear if q8 else Int4Linear)
    assert isinstance(kept.loaded.model.model.embed_tokens, PackedEmbedding)


@pytest.fixture(scope="module")
def default_dense() -> dict[str, object]:
    """The default model dequantized by the gguf package (`--quantize none`), float32."""
    return default_model_check.run("float32", quantize="none")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_kept_quantized_matches_dequantized(
    default_dense, default_gguf_path: str, dtype: str,
) -> None:
    got = default_model_check.run(dtype)
    _check_default_model(got, default_dense, default_gguf_path, dtype)


def test_default_model_decoding_through_the_fused_layers_matches_dequantized(
    default_dense, default_gguf_path: str,
) -> None:
    """The compiled decode step, where our kernels are built: its layers in one C++ call
    (fused_decode_layers.py) give the same tokens, within the same logit tolerance."""
    got = default_model_check.run("float32", compile=True)
    assert got["fused"] == (got["kernels"] is not None)
    _check_default_model(got, default_dense, default_gguf_path, "float32")


def test_default_model_kept_packed_with_avx2_packing(
    default_dense, default_gguf_path: str, tmp_path: Path,
) -> None:
    """torch packs int4 in other blocks on AVX2: the tied embedding must stay packed there
    too. float32, the engine's dtype where bf16 matmuls are slow (AVX2)."""
    if not has_avx2():
        pytest.skip("this CPU has no AVX2: torch cannot dispatch to its AVX2 kernels")
    out = tmp_path / "avx2.pt"
    run_in_child("tests.quantized.default_model_check", "avx2", str(out), "float32")
    got = torch.load(out)
    assert got["capability"] == "AVX2"
    _check_default_model(got, default_dense, default_gguf_path, "float32")


def _check_default_model(got: dict, dense: dict, path: str, dtype: str) -> None:
    assert got["quantization"] == "gguf (kept quantized)"
    assert got["packed"], "the tied embedding is not read from the packed lm_head"
    # 8-bit where our kernels run (AVX2 or AVX-512 VNNI), else two int4 halves
    assert got["lm_head"] == ("Q8Linear" if got["kernels"] is not None else "Int4Linear")
    assert got["tokens"] == dense["tokens"]
    diff = (got["logits"] - dense["logits"]).abs().max().item()
    assert diff <= DEFAULT_TOLERANCE[dtype], f"{dtype}: max logit difference {diff:.3f}"
    ratio = got["weight_bytes"] / _bf16_bytes(path)
    assert ratio <= DEFAULT_BUDGET, f"{got['weight_bytes']} bytes: {ratio:.3f} of bf16"
