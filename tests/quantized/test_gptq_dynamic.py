"""gptqmodel's per-module `dynamic` rules in a GPTQ quantization_config: the first matching
pattern sets a module's layout, a `-:` pattern leaves it unquantized (dense in the checkpoint).
The quantized 8-bit lm_head fixture (gptqmodel's own `lm_head=True` output) is covered with
the other fixtures in test_gptq_awq.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from backends.native.layers.cpu_linear import PrepackedLinear, can_prepack
from backends.quantized.config import GPTQConfig, QuantizationError, resolve_quantization
from tests.quantized.helpers import (
    LOGIT_TOLERANCE,
    fixture_folder,
    make_engine,
    native_greedy,
    reference,
    teacher_forced_logits,
)
from tests.quantized.reference_dequant import dense_model, gptq_dense

GPTQ = "gptq-w4-g64-sym"
DOWN = "model.layers.1.mlp.down_proj"


def _config(**quantization) -> GPTQConfig:
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, **quantization}

    class HFConfig:
        quantization_config = qc

    config = resolve_quantization(HFConfig(), "safetensors", None)
    assert isinstance(config, GPTQConfig)
    return config


def test_first_matching_rule_decides() -> None:
    config = _config(dynamic={
        r"-:.*\.mlp\.down_proj": {},
        r"+:model\.layers\.1\..*": {"bits": 8, "group_size": 32, "mse": 2.4},
        r"lm_head": {"bits": 8, "sym": False},
    })
    assert config.for_module("model.layers.1.mlp.down_proj") is None
    layer1 = config.for_module("model.layers.1.self_attn.q_proj")
    assert (layer1.bits, layer1.group_size, layer1.sym) == (8, 32, True)
    head = config.for_module("lm_head")
    assert (head.bits, head.group_size, head.sym) == (8, 64, False)
    other = config.for_module("model.layers.0.self_attn.q_proj")
    assert (other.bits, other.group_size, other.dynamic) == (4, 64, ())


@pytest.mark.parametrize(("dynamic", "fragment"), [
    ({"+:model.(": {}}, "bad pattern '+:model.('"),
    ({"lm_head": {"bits": 3}}, "dynamic['lm_head']"),
    ({"lm_head": 8}, "dynamic['lm_head'] is not a mapping"),
    ([["lm_head", {}]], "dynamic is not a mapping"),
])
def test_bad_rules_are_named(dynamic, fragment: str) -> None:
    with pytest.raises(QuantizationError) as info:
        _config(dynamic=dynamic)
    assert fragment in str(info.value)


@pytest.fixture(scope="module")
def excluded(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GPTQ fixture with one Linear excluded by a `-:` rule and stored dense, as
    gptqmodel saves a module it was told to skip (its plain dequantization, bf16)."""
    folder = fixture_folder(GPTQ, tokenizer_dir, tmp_path_factory.mktemp("dynamic"))
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    dense = gptq_dense(tensors, DOWN, bits=4).to(torch.bfloat16)
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        tensors.pop(f"{DOWN}.{suffix}")
    tensors[f"{DOWN}.weight"] = dense.contiguous()
    save_file(tensors, str(path))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["dynamic"] = {f"-:{re.escape(DOWN)}": {}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_excluded_module_loads_dense(excluded: Path) -> None:
    engine = make_engine(excluded)
    module = engine.loaded.model.get_submodule(DOWN)
    # dense: prepacked where oneDNN has a bf16 path (not on AVX2-only CPUs), else plain
    dense = PrepackedLinear if can_prepack(torch.device("cpu"), torch.bfloat16) else nn.Linear
    assert type(module) is dense
    assert (module.dtype if dense is PrepackedLinear else module.weight.dtype) == torch.bfloat16
    assert "per-module rules: 1" in engine.loaded.quantization
    prompt = reference(GPTQ)["prompt"].tolist()
    tokens, logits = native_greedy(engine, prompt)
    want = teacher_forced_logits(
        dense_model(excluded, lambda t, prefix: gptq_dense(t, prefix, bits=4)), prompt, tokens
    )
    assert want.argmax(-1).tolist() == tokens
    assert (logits - want).abs().max().item() <= LOGIT_TOLERANCE


def test_partly_excluded_fused_projection_is_refused(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    folder = fixture_folder(GPTQ, tokenizer_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["dynamic"] = {r"-:.*\.self_attn\.k_proj": {}}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError) as info:
        make_engine(folder)
    assert "qkv_proj" in str(info.value) and "k_proj" in str(info.value)
