"""CUDA paths of the quantized Linears (torch tinygemm int4, int8 widen / eetq, bitsandbytes),
against float32 matmuls of the same dequantized weights; gptqmodel's CUDA kernels chosen by
`--quantized-kernels auto` on the GPTQ / AWQ fixtures, against their recorded references. Run
by bench/gpu_check.sh where a GPU is lent; skipped elsewhere."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from backends.quantized.affine import AffineInt4, AffineInt8
from backends.quantized.config import BnbConfig
from backends.quantized.int4_linear import Int4Linear
from backends.quantized.int8_linear import Int8Linear, quantize_per_channel
from backends.quantized.linear import LinearSpec, ShardedLinear
from tests.quantized.helpers import (
    FIXTURES,
    assert_close_greedy,
    fixture_folder,
    make_engine,
    native_greedy,
    reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def _affine(n: int, k: int, group: int, act_order: bool, seed: int = 0) -> AffineInt4:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.01 + 0.001
    zeros = torch.randint(0, 16, (n, k // group), generator=gen).float()
    perm = torch.randperm(k, generator=gen) if act_order else None
    return AffineInt4.from_int_zeros(q, scale, zeros, group, perm)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    assert (got.float().cpu() - want).abs().max().item() <= 2e-2 * scale


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_tinygemm(group: int, act_order: bool, rows: int) -> None:
    weight = _affine(512, 1024, group, act_order)
    module = Int4Linear(weight, None, CUDA, torch.bfloat16)
    assert module.kernel == "cuda-tinygemm"
    x = torch.randn(rows, 1024)
    _close(module(x.to(CUDA, torch.bfloat16)), x @ weight.dense().t())


def test_int4_in_float16_model() -> None:
    weight = _affine(256, 512, 64, False)
    module = Int4Linear(weight, torch.randn(256), CUDA, torch.float16)
    x = torch.randn(5, 512)
    want = x @ weight.dense().t() + module.bias.float().cpu()
    _close(module(x.to(CUDA, torch.float16)), want)


def test_8bit_as_two_int4_halves() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 256, (256, 512), generator=gen, dtype=torch.uint8)
    eight = AffineInt8(q, torch.rand(256, 8, generator=gen) * 1e-3,
                       torch.randint(100, 156, (256, 8), generator=gen).float(), 64)
    module = Int4Linear(eight.as_int4_halves(), None, CUDA, torch.bfloat16)
    x = torch.randn(3, 512)
    _close(module(x.to(CUDA, torch.bfloat16)), x @ eight.dense().t())


def test_int8_per_channel() -> None:
    w = torch.randn(384, 512) * 0.05
    q, scale = quantize_per_channel(w)
    module = Int8Linear(q, scale, None, CUDA, torch.float16)
    x = torch.randn(4, 512)
    _close(module(x.to(CUDA, torch.float16)), x @ (q.float() * scale[:, None]).t())


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_bitsandbytes(kind: str) -> None:
    pytest.importorskip("bitsandbytes")
    from backends.quantized.bnb import BnbWeightsLoader

    w = torch.randn(256, 512) * 0.05
    spec = LinearSpec("l", ["l"], 512, [256], False, CUDA, torch.float16)
    module = BnbWeightsLoader(BnbConfig(kind=kind, prequantized=False)).build(
        spec, [{"weight": w}]
    )
    x = torch.randn(4, 512)
    got = module(x.to(CUDA, torch.float16)).float().cpu()
    assert (got - x @ w.t()).abs().max() <= 0.15 * (x @ w.t()).abs().max()


# Skipped before its fixtures run: `tokenizer_dir` needs the default model's package.
@pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None, reason="needs gptqmodel")
@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*-w4-*")))
def test_auto_picks_a_gptqmodel_cuda_kernel(name: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    """`auto` on CUDA: gptqmodel's fastest kernel that takes the layout (Marlin / Machete /
    ExLlamaV2 for GPTQ, Marlin / GEMM / ExLlamaV2 for AWQ), never its generic torch ones."""
    from gptqmodel.models._const import DEVICE

    engine = make_engine(fixture_folder(name, tokenizer_dir, tmp_path), device="cuda")
    model = engine.loaded.model
    kernels = set()
    for linear in model.quantizable_linears():
        module = model.get_submodule(linear)
        for part in module.parts if isinstance(module, ShardedLinear) else [module]:
            assert DEVICE.CUDA in type(part.qlinear).SUPPORTS_DEVICES, part.kernel
            kernels.add(part.kernel)
    print(f"{name}: {engine.loaded.quantization}; linears: {sorted(kernels)}")
    assert "kernel: gptqmodel " in engine.loaded.quantization
    ref = reference(name)
    assert_close_greedy(*native_greedy(engine, ref["prompt"].tolist()),
                        ref["tokens"].tolist(), ref["logits"])
