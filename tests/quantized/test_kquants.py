"""GGUF Q5_0 / Q5_1 / Q5_K / Q6_K kept as the file's blocks, repacked at load
(backends/quantized/kquant_linear.py on backends/cpu_kernels/kquant_dot.cpp): the kernel's
products, on the repacked layout and on the blocks as stored, against the gguf package's
dequantization, on this CPU's code and, in a child process, the AVX2 code; whole files in
llama.cpp's Q4_K_M / Q5_K_M / Q6_K type mixes loaded packed against their dequantized copy;
and /info naming the formats kept and each tensor dequantized, with why."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from backends.cpu_kernels.build import active_variant
from backends.native.llm_engine import LLMEngine
from backends.quantized import kquant_linear
from backends.quantized.gguf import gguf_formats
from backends.quantized.int4_linear import Int4Linear
from backends.quantized.kquant_linear import DENSE_MIN_ROWS, KQuantLinear
from backends.quantized.linear import ShardedLinear
from tests.quantized.gguf_files import blocks, dequantized_copy, tensor_bytes, write_tiny_gguf
from tests.quantized.helpers import has_avx2, make_engine, native_greedy, run_in_child

T = GGMLQuantizationType
TYPES = [T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K]
# (N, K): K of 1 / 3 / 5 segments of the AVX2 code (128 columns), 1 / 1.5 / 2.5 of AVX-512's
# (256); Q5_0 / Q5_1 also K = 96 and 352, not a multiple of either.
SHAPES = [(48, 256), (40, 768), (17, 1280)]
SMALL_BLOCK_SHAPES = [(16, 96), (33, 352)]
ROWS = (1, 16, 70)  # decode, a decode batch, a prompt (not a multiple of the 4-row tile)
# Max |kernel - x @ dequantize(blocks)| / max |x @ dequantize(blocks)| over TYPES x shapes x
# ROWS, AVX-512 and AVX2 code alike: float32 4.1e-5 (inputs as two int8 passes per 32
# columns), bf16 3.5e-3 (bf16 inputs and outputs); about 2.5x that. One int8 pass measured
# 7.4e-3 in float32.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 8e-3}
# Against the same product with the inputs quantized as the kernel does (float64): 3.7e-7
# measured, float32 summation order only.
EMULATED_TOLERANCE = 1e-5
# The repacked layout against the file's bytes: Q4_K / Q5_K's scales and mins as whole bytes,
# and on AVX2 (128-column segments) d / dmin per 128 columns: AVX-512 Q4_K 1.028x, Q5_K
# 1.023x, the others 1.0; AVX2 Q4_K 1.056x, Q5_K 1.045x, Q6_K 1.010x, Q5_0 / Q5_1 1.0.
PACKED_BYTES = 1.06


def _blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> torch.Tensor:
    values = np.random.default_rng(seed).normal(0, 0.1, (n, k)).astype(np.float32)
    return torch.from_numpy(blocks(values, qtype, np.random.default_rng(seed + 1)))


def _dequantized(data: torch.Tensor, qtype: GGMLQuantizationType, k: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(data.numpy(), qtype).reshape(-1, k).astype(np.float32))


def _int8_inputs(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel quantizes it: per 32 columns d = amax / 127, s = x * (1 / d),
    x ~ (round(s) + round((s - round(s)) * 254) / 254) * d."""
    blocks32 = x.float().view(x.shape[0], -1, 32)
    d = blocks32.abs().amax(-1, keepdim=True) / 127
    scaled = blocks32 * torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(scaled)
    rest = torch.round((scaled - q) * 254)
    return ((q.double() + rest.double() / 254) * d.double()).view(x.shape)


def check_products() -> str:
    """kquant_mm against gguf's dequantization (and exactly against an emulation of its int8
    inputs), both input dtypes; dequantize exactly gguf's values; a row alone gets the bits it
    gets among others."""
    assert kquant_linear.available(torch.device("cpu"), torch.float32), active_variant()
    for qtype in TYPES:
        shapes = SHAPES + (SMALL_BLOCK_SHAPES if qtype in (T.Q5_0, T.Q5_1) else [])
        for seed, (n, k) in enumerate(shapes):
            data = _blocks(qtype, n, k, seed)
            weight = _dequantized(data, qtype, k)
            ours = torch.ops.switchyard_cpu.kquant_dequantize(data, int(qtype), k, torch.float32)
            assert torch.equal(ours, weight), (qtype.name, n, k)
            packed = torch.ops.switchyard_cpu.kquant_pack(data, int(qtype), k)
            assert packed.shape[0] == n and packed.numel() <= PACKED_BYTES * data.numel()
            ours = torch.ops.switchyard_cpu.kquant_packed_dequantize(packed, int(qtype), k,
                                                                     torch.float32)
            assert torch.equal(ours, weight), (qtype.name, n, k, "packed")
            # The kernel on the repacked layout (KQuantLinear's) and on the file's blocks.
            kernels = {"packed": (torch.ops.switchyard_cpu.kquant_packed_mm, packed),
                       "blocks": (torch.ops.switchyard_cpu.kquant_mm, data)}
            for layout, (kernel, stored) in kernels.items():
                for rows in ROWS:
                    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                    for dtype, tolerance in TOLERANCE.items():
                        got = kernel(x.to(dtype), stored, int(qtype), k)
                        assert got.dtype == dtype and got.shape == (rows, n)
                        want = x.to(dtype).double() @ weight.double().t()
                        diff = (got.double() - want).abs().max().item()
                        assert diff <= tolerance * want.abs().max().item(), (
                            qtype.name, layout, n, k, rows, dtype, diff)
                    got = kernel(x, stored, int(qtype), k).double()
                    emulated = _int8_inputs(x) @ weight.double().t()
                    diff = (got - emulated).abs().max().item()
                    assert diff <= EMULATED_TOLERANCE * emulated.abs().max().item(), (
                        qtype.name, layout, k)
                    alone = kernel(x[-1:].contiguous(), stored, int(qtype), k)
                    assert torch.equal(alone[0], got[-1].float()), (qtype.name, layout, k)
    return active_variant() or ""


def needs_kernel() -> None:
    if not kquant_linear.available(torch.device("cpu"), torch.float32):
        pytest.skip("our CPU kernels do not run here")


def test_products_match_gguf_dequantization() -> None:
    needs_kernel()
    check_products()


def test_avx2_code_where_torch_dispatches_to_avx2() -> None:
    if not has_avx2():
        pytest.skip("this CPU has no AVX2")
    assert run_in_child("tests.quantized.test_kquants", "avx2").split() == ["avx2"]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_both_paths_rows_and_bias(qtype: GGMLQuantizationType) -> None:
    """KQuantLinear: the kernel and, from DENSE_MIN_ROWS rows, dequantize + matmul; rows()
    (a tied embedding's lookups) exactly the weight's rows; the bias added once."""
    needs_kernel()
    data = _blocks(qtype, 64, 512, 7)
    weight = _dequantized(data, qtype, 512)
    bias = torch.randn(64)
    module = KQuantLinear(data, qtype, 512, bias, torch.device("cpu"), torch.float32, [16, 48])
    for rows in (3, DENSE_MIN_ROWS + 5):
        x = torch.randn(2, rows, 512, generator=torch.Generator().manual_seed(rows))
        want = x.double() @ weight.double().t() + bias.double()
        got = module(x)
        assert got.shape == (2, rows, 64)
        assert (got.double() - want).abs().max().item() <= \
            TOLERANCE[torch.float32] * want.abs().max().item(), rows
    index = torch.tensor([63, 0, 17, 17])
    assert torch.equal(module.rows(index), weight[index])
    assert module.shards == [16, 48]
    assert module.packed.numel() <= PACKED_BYTES * data.numel()  # ~the file's bytes


def test_a_malformed_call_raises_a_clear_error() -> None:
    needs_kernel()
    data = _blocks(T.Q6_K, 16, 512, 3)
    with pytest.raises(RuntimeError, match="x has 256 columns, the weight 512"):
        torch.ops.switchyard_cpu.kquant_mm(torch.randn(2, 256), data, int(T.Q6_K), 512)
    with pytest.raises(RuntimeError, match="need rows of 420 bytes"):
        torch.ops.switchyard_cpu.kquant_mm(torch.randn(2, 512), data[:, :400].contiguous(),
                                           int(T.Q6_K), 512)
    with pytest.raises(RuntimeError, match="is not Q5_0"):
        torch.ops.switchyard_cpu.kquant_mm(torch.randn(2, 512), data, int(T.Q3_K), 512)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.switchyard_cpu.kquant_mm(torch.randn(2, 512).half(), data, int(T.Q6_K), 512)


# llama.cpp's mixes on the 2-layer test model: Q6_K for attn_v and ffn_down in layer 0 (about
# half the layers) and for the tied token_embd / output; the rest the mix's own type.
def _mix(base: GGMLQuantizationType):
    def choose(stem: str, layer: int) -> GGMLQuantizationType:
        return T.Q6_K if stem in ("attn_v", "ffn_down") and layer == 0 else base
    return choose


MIXES = {"Q4_K_M": _mix(T.Q4_K), "Q5_K_M": _mix(T.Q5_K), "Q6_K": _mix(T.Q6_K)}
# Max |logit - dequantized copy's logit|, float32, 4 greedy steps after 3 prompts of 12 tokens
# (the kernels) and one of DENSE_MIN_ROWS + 32 (dequantize + matmul), logits up to 1.8:
# measured Q4_K_M 2.7e-4, Q5_K_M 2.8e-4, Q6_K 1.7e-4 (one int8 input pass: 0.017, 0.055,
# 0.065); about 3.5x that. Tokens are compared where the reference's top-2 margins all exceed
# twice this (the random models' margins run from 0.002 to 0.11).
MODEL_TOLERANCE = 1e-3
# The kept model's resident weights against the file's tensor bytes (measured 1.006 for
# Q4_K_M, whose Q4_K linears take 5 bits a weight as int4, and 1.000 for Q5_K_M and Q6_K).
BYTES_BUDGET = 1.1


@pytest.fixture(scope="module", params=sorted(MIXES))
def mix_file(request, tmp_path_factory, default_gguf_path: str) -> tuple[str, Path, Path]:
    folder = tmp_path_factory.mktemp("kquant")
    path = write_tiny_gguf(folder / f"{request.param}.gguf", default_gguf_path,
                           lambda stem: T.F32, embed_type=T.Q6_K,
                           layer_type=MIXES[request.param])
    return request.param, path, dequantized_copy(path, folder / f"{request.param}-f32.gguf")


def test_mixes_load_packed_and_match_their_dequantized_copy(mix_file) -> None:
    needs_kernel()
    name, path, dense_path = mix_file
    kept = make_engine(path, dtype="float32", max_total_tokens=256)
    dense = make_engine(dense_path, dtype="float32", max_total_tokens=256)
    formats = gguf_formats(kept.loaded.model)
    assert formats.expanded == [], formats.expanded
    assert kept.loaded.gguf_formats == formats
    assert formats.kept == sorted({"Q6_K", name[:4]})
    layer0, layer1 = kept.loaded.model.model.layers[:2]
    assert isinstance(kept.loaded.model.lm_head, KQuantLinear)
    if name == "Q6_K":
        assert isinstance(layer0.self_attn.qkv_proj, KQuantLinear)
    else:  # q / k of the mix's type, v Q6_K: shards apart
        assert isinstance(layer0.self_attn.qkv_proj, ShardedLinear)
        assert isinstance(layer1.self_attn.qkv_proj, Int4Linear if name == "Q4_K_M"
                          else KQuantLinear)
    ratio = kept.loaded.weight_bytes / tensor_bytes(path)
    assert ratio <= BYTES_BUDGET, ratio
    assert_greedy_close_to_dense(kept, dense, MODEL_TOLERANCE, name)


def assert_greedy_close_to_dense(kept: LLMEngine, dense: LLMEngine, tolerance: float,
                                 label: str) -> None:
    """4 greedy steps after 3 prompts of 12 tokens (the kernels) and one of DENSE_MIN_ROWS +
    32 (dequantize + matmul): logits within `tolerance` of the dense engine's, and the same
    tokens wherever the dense engine's top-2 margins all exceed twice that."""
    gen = torch.Generator().manual_seed(0)
    for length in (12, 12, 12, DENSE_MIN_ROWS + 32):
        prompt = torch.randint(3, 49152, (length,), generator=gen).tolist()
        want_tokens, want = native_greedy(dense, prompt, steps=4)
        tokens, got = native_greedy(kept, prompt, steps=4)
        same = 4 if tokens == want_tokens else 1  # later steps: only on the same tokens
        diff = (got[:same] - want[:same]).abs().max().item()
        assert diff <= tolerance, (label, length, diff)
        top2 = want.topk(2).values
        if ((top2[:, 0] - top2[:, 1]) > 2 * tolerance).all():
            assert tokens == want_tokens, (label, length)


def test_info_lists_formats_kept_and_tensors_expanded(default_gguf_path: str,
                                                      tmp_path: Path) -> None:
    """A real server's /info: the Q4_K_M mix with a Q3_K attn_output (no kernel of ours) and
    an F16 ffn_up (float, dense on purpose) in layer 1."""
    from backends.native.backend import NativeBackend
    from backends.native.config import EngineConfig
    from gateway.app import create_app
    from gateway.settings import Settings
    from tests.gateway.conftest import running_server
    from tests.gateway.test_sampling_defaults import _wait_ready

    needs_kernel()
    extra = {("attn_output", 1): T.Q3_K, ("ffn_up", 1): T.F16}
    path = write_tiny_gguf(
        tmp_path / "expanded.gguf", default_gguf_path, lambda stem: T.F32, embed_type=T.Q6_K,
        layer_type=lambda stem, layer: extra.get((stem, layer)) or _mix(T.Q4_K)(stem, layer))
    backend = NativeBackend(EngineConfig(model=str(path), served_model_name="tiny",
                                         dtype="float32", max_total_tokens=64, compile=False))
    # The model loads in uvicorn's startup (the lifespan): a GGUF start takes seconds.
    with running_server(create_app(Settings(), backends={"tiny": backend}),
                        timeout_s=120) as url:
        _wait_ready(url)
        body = httpx.get(f"{url}/info").json()
    assert body["gguf_formats"] == {
        "kept": ["Q4_K", "Q6_K"],
        "expanded": [
            {"tensor": "blk.1.attn_output.weight", "type": "Q3_K",
             "reason": "no kernel for Q3_K"},
            {"tensor": "model.layers.1.mlp.up_proj.weight", "type": "float",
             "reason": "float weights stay dense"},
        ],
    }


if __name__ == "__main__":
    print(check_products())
