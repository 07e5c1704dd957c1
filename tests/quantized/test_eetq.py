"""EETQ (`--quantize eetq`): int8 per-output-channel symmetric weights, quantized at load,
against a dense transformers model whose Linears hold the same per-channel int8 weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from backends.quantized.int8_linear import Int8Linear
from tests.fixtures.quantized._common import greedy_record, write_base_model
from tests.quantized.helpers import (
    assert_close_greedy,
    cached_greedy,
    dense_linear_bytes,
    make_engine,
    native_greedy,
    quantized_linear_bytes,
)


def int8_per_channel(weight: torch.Tensor) -> torch.Tensor:
    """Reference: scale = max |w| / 127 per output row, w ~ round(w / scale) * scale."""
    w = weight.double()
    scale = w.abs().max(dim=1, keepdim=True).values / 127
    return (torch.round(w / scale).clamp(-127, 127) * scale).float()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    folder = write_base_model(tmp_path_factory.mktemp("eetq") / "base", torch.bfloat16)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, folder / item.name)
    return folder


@pytest.fixture(scope="module")
def reference_model(base: Path):
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("_proj"):
                module.weight.copy_(int8_per_channel(module.weight))
    return model.to(torch.bfloat16).eval()


def test_matches_per_channel_int8_reference(base: Path, reference_model) -> None:
    record = next(
        r for seed in range(1000)
        if (r := greedy_record(lambda ids: reference_model(input_ids=ids).logits, seed))
    )
    want_tokens, want_logits = cached_greedy(reference_model, record["prompt"].tolist())
    engine = make_engine(base, quantize="eetq")
    tokens, logits = native_greedy(engine, record["prompt"].tolist())
    assert_close_greedy(tokens, logits, want_tokens, want_logits)
    assert engine.loaded.quantization.startswith("eetq")


def test_int8_kernel_and_half_the_bytes(base: Path) -> None:
    engine = make_engine(base, quantize="eetq")
    layer = engine.loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int8Linear)
    assert layer.self_attn.qkv_proj.q.dtype == torch.int8
    ratio = quantized_linear_bytes(engine) / dense_linear_bytes(engine.loaded.hf_config)
    assert ratio <= 0.52, ratio
