"""GPTQ and AWQ on gptqmodel's kernels (`quantized_kernels="gptqmodel"`). On CPU gptqmodel
picks its ATen int4 kernels (TorchAtenLinear, TorchAtenAwqLinear) or, where those take no
layout (8-bit, per-channel 4-bit), its torch dequantization (TorchLinear). Every fixture's 16
greedy tokens and logits are compared with the reference library's and the native kernels';
single Linears with the plain dequantization. CUDA's choice: test_cuda.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from backends.quantized import gptqmodel_kernels
from backends.quantized.awq import AWQWeightsLoader
from backends.quantized.config import AWQConfig, GPTQConfig, QuantizationError
from backends.quantized.gptq import GPTQWeightsLoader
from backends.quantized.gptqmodel_kernels import GPTQModelLinear
from backends.quantized.int4_linear import Int4Linear
from backends.quantized.int8_linear import Int8Linear
from backends.quantized.linear import LinearSpec, ShardedLinear
from backends.quantized.resident import resident_bytes
from tests.quantized.helpers import (
    FIXTURES,
    assert_close_greedy,
    cached_greedy,
    fixture_folder,
    make_engine,
    native_greedy,
    reference,
)
from tests.quantized.reference_dequant import awq_dense, gptq_dense

pytest.importorskip("gptqmodel")
from gptqmodel.nn_modules.qlinear import BaseQuantLinear  # noqa: E402

GPTQ = sorted(p.name for p in FIXTURES.glob("gptq-*"))
AWQ = sorted(p.name for p in FIXTURES.glob("awq-*"))
CPU = torch.device("cpu")
ATTN = "model.layers.0.self_attn"


def _loader(name: str, kernels: str = "gptqmodel"):
    qc = json.loads((FIXTURES / name / "config.json").read_text())["quantization_config"]
    if name.startswith("gptq"):
        config = GPTQConfig(qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"])
        return GPTQWeightsLoader(config, kernels), lambda t, p: gptq_dense(t, p, qc["bits"])
    group = qc.get("group_size", qc.get("q_group_size"))
    return AWQWeightsLoader(AWQConfig(4, group, True), kernels), lambda t, p: awq_dense(t, p, group)


def _parts(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix + "."): v for k, v in tensors.items()
            if k.startswith(prefix + ".")}


def _spec(prefixes: list[str], k: int, shards: list[int]) -> LinearSpec:
    return LinearSpec("l", prefixes, k, shards, False, CPU, torch.bfloat16)


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float = 2e-2) -> None:
    diff = (got.float() - want).abs().max().item()
    assert diff <= tolerance * want.abs().max().item(), diff


def _gptqmodel_parts(module) -> list[GPTQModelLinear]:
    return list(module.parts) if isinstance(module, ShardedLinear) else [module]


@pytest.fixture(scope="module", params=GPTQ + AWQ)
def case(request, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    folder = fixture_folder(name, tokenizer_dir, tmp_path_factory.mktemp("q"))
    prompt = reference(name)["prompt"].tolist()
    engine = make_engine(folder, quantized_kernels="gptqmodel")
    return name, engine, native_greedy(engine, prompt), folder


def test_engine_linears_are_gptqmodel_modules(case) -> None:
    _, engine, _, _ = case
    model = engine.loaded.model
    for linear in model.quantizable_linears():
        module = model.get_submodule(linear)
        assert module.kernel.startswith("gptqmodel "), (linear, module.kernel)
        for part in _gptqmodel_parts(module):
            assert isinstance(part, GPTQModelLinear)
            assert isinstance(part.qlinear, BaseQuantLinear)
            assert type(part.qlinear).__name__ not in ("TorchFusedLinear", "TorchFusedAwqLinear")
    assert "kernel: gptqmodel " in engine.loaded.quantization
    assert engine.loaded.weight_bytes > 0


def test_matches_reference_library(case) -> None:
    name, _, (tokens, logits), _ = case
    ref = reference(name)
    assert_close_greedy(tokens, logits, ref["tokens"].tolist(), ref["logits"])


def test_loads_as_transformers_and_gptqmodel_do(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Where gptqmodel picks the kernel transformers' integration is told to use (TorchLinear
    for per-channel 4-bit), the engine's logits are transformers' to float noise: the same
    tensors go into the same buffers (scales in the checkpoint's dtype, v1 zero points
    converted the same way). bf16-rounded scales were 0.02 off."""
    from transformers import AutoModelForCausalLM
    from transformers import GPTQConfig as HFGPTQConfig

    name = "gptq-w4-channel-asym"
    folder = fixture_folder(name, tokenizer_dir, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, device_map="cpu",
        quantization_config=HFGPTQConfig(bits=4, backend="torch"),
    ).eval()
    prompt = reference(name)["prompt"].tolist()
    engine = make_engine(folder, quantized_kernels="gptqmodel")
    assert engine.loaded.model.model.layers[0].mlp.down_proj.kernel == "gptqmodel TorchLinear"
    assert_close_greedy(*native_greedy(engine, prompt), *cached_greedy(model, prompt),
                        tolerance=1e-3)


def test_matches_native_kernels(case) -> None:
    name, _, (tokens, logits), folder = case
    native = make_engine(folder, quantized_kernels="native")
    assert not any(isinstance(m, GPTQModelLinear) for m in native.loaded.model.modules())
    assert_close_greedy(tokens, logits, *native_greedy(native, reference(name)["prompt"].tolist()))


@pytest.mark.parametrize("name", ["gptq-w4-g32-asym-actorder", "gptq-w8-g64-asym", "awq-w4-g64"])
@pytest.mark.parametrize("rows", [1, 7])
def test_linear_matches_plain_dequantization(name: str, rows: int) -> None:
    loader, dequantize = _loader(name)
    tensors = load_file(str(FIXTURES / name / "model.safetensors"))
    prefix = "model.layers.1.mlp.down_proj"
    weight = dequantize(tensors, prefix)
    module = loader.build(_spec([prefix], weight.shape[1], [weight.shape[0]]),
                          [_parts(tensors, prefix)])
    assert isinstance(module, GPTQModelLinear) and module.shards == [weight.shape[0]]
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
    out = module(x.bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, weight.shape[0])
    _close(out, x.bfloat16().float() @ weight.t())


@pytest.mark.parametrize("name", ["gptq-w4-g32-asym-actorder", "awq-w4-g32"])
def test_fused_qkv_matches_per_shard(name: str) -> None:
    loader, _ = _loader(name)
    tensors = load_file(str(FIXTURES / name / "model.safetensors"))
    prefixes = [f"{ATTN}.{p}_proj" for p in "qkv"]
    parts = [_parts(tensors, p) for p in prefixes]
    sizes = [p["scales"].shape[1] for p in parts]
    fused = loader.build(_spec(prefixes, 128, sizes), parts)
    assert isinstance(fused, GPTQModelLinear) and fused.shards == sizes
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    single = [loader.build(_spec([p], 128, [n]), [q])
              for p, n, q in zip(prefixes, sizes, parts, strict=True)]
    torch.testing.assert_close(fused(x), torch.cat([m(x) for m in single], -1),
                               atol=1e-2, rtol=1e-2)


def test_shards_with_different_act_order_stay_separate() -> None:
    loader, dequantize = _loader("gptq-w4-g32-asym-actorder")
    tensors = load_file(str(FIXTURES / "gptq-w4-g32-asym-actorder" / "model.safetensors"))
    key = f"{ATTN}.k_proj.g_idx"
    tensors[key] = tensors[key][torch.randperm(128, generator=torch.Generator().manual_seed(0))]
    prefixes = [f"{ATTN}.{p}_proj" for p in "qk"]
    module = loader.build(_spec(prefixes, 128, [128, 64]), [_parts(tensors, p) for p in prefixes])
    assert isinstance(module, ShardedLinear) and module.shards == [128, 64]
    assert module.kernel.startswith("gptqmodel ")
    want = torch.cat([dequantize(tensors, p) for p in prefixes])
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    _close(module(x), x.float() @ want.t())


def test_resident_bytes_count_the_repacked_tensors() -> None:
    loader, _ = _loader("gptq-w4-g64-sym")
    tensors = load_file(str(FIXTURES / "gptq-w4-g64-sym" / "model.safetensors"))
    prefix = "model.layers.0.mlp.down_proj"
    module = loader.build(_spec([prefix], 256, [128]), [_parts(tensors, prefix)])
    assert type(module.qlinear).__name__ == "TorchAtenLinear"
    assert module.extra_bytes() > 0  # scales_and_zeros: made at load, not a buffer
    assert 128 * 256 // 2 < resident_bytes(module) <= 128 * 256  # 4 bits + group data < 8 bits


def test_forced_without_gptqmodel_is_a_clear_error(monkeypatch, tokenizer_dir, tmp_path) -> None:
    def missing():
        raise ImportError("No module named 'gptqmodel'")

    monkeypatch.setattr(gptqmodel_kernels, "_import_gptqmodel", missing)
    folder = fixture_folder("gptq-w4-g64-sym", tokenizer_dir, tmp_path)
    with pytest.raises(QuantizationError, match="gptqmodel cannot be imported.*pip install"):
        make_engine(folder, quantized_kernels="gptqmodel")
    auto = make_engine(folder)  # auto on CPU never imports gptqmodel
    assert isinstance(auto.loaded.model.model.layers[0].mlp.down_proj, Int4Linear)


def test_forced_without_a_kernel_for_the_layout_names_it() -> None:
    loader, _ = _loader("gptq-w8-g64-asym")
    message = "gptqmodel has no kernel for gptq 8-bit group 64 asym on cpu in float32"
    with pytest.raises(QuantizationError, match=message):
        loader.kernel(CPU, torch.float32)


@pytest.mark.parametrize("name", ["gptq-w4-g64-sym", "gptq-w8-channel-sym-actorder", "awq-w4-g64"])
def test_auto_on_cpu_picks_native(name: str) -> None:
    loader, _ = _loader(name, "auto")
    assert not loader.kernel(CPU, torch.bfloat16).startswith("gptqmodel")
    tensors = load_file(str(FIXTURES / name / "model.safetensors"))
    prefix = "model.layers.0.mlp.down_proj"
    module = loader.build(_spec([prefix], 256, [128]), [_parts(tensors, prefix)])
    assert isinstance(module, Int4Linear | Int8Linear)


def test_setting_is_checked_and_passed_from_the_cli() -> None:
    from backends.native.config import EngineConfig
    from gateway.cli import build_parser, settings_from_args

    with pytest.raises(QuantizationError, match="'fast' is not one of auto, native, gptqmodel"):
        EngineConfig(model="default", quantized_kernels="fast")
    args = build_parser().parse_args(["serve", "--quantized-kernels", "gptqmodel"])
    (spec,) = settings_from_args(args).model_specs()
    assert spec.options["quantized_kernels"] == "gptqmodel"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantized-kernels", "fast"])
