"""bitsandbytes, live against transformers + bitsandbytes on CPU (bf16): nf4 / fp4 / LLM.int8
quantized at load (`--quantize`), and the checkpoints transformers saves of those models."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.fixtures.quantized._common import greedy_record, write_base_model
from tests.quantized.helpers import (
    LOGIT_TOLERANCE,
    assert_close_greedy,
    cached_greedy,
    dense_linear_bytes,
    make_engine,
    native_greedy,
    quantized_linear_bytes,
)

bnb = pytest.importorskip("bitsandbytes")

KINDS = {"bitsandbytes-nf4": "nf4", "bitsandbytes-fp4": "fp4", "bitsandbytes": "int8"}


def _bnb_config(kind: str):
    from transformers import BitsAndBytesConfig

    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind,
                              bnb_4bit_compute_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    folder = write_base_model(tmp_path_factory.mktemp("bnb") / "base", torch.bfloat16)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, folder / item.name)
    return folder


@pytest.fixture(scope="module", params=sorted(KINDS))
def case(request, base: Path, tmp_path_factory: pytest.TempPathFactory):
    """(flag, reference record, pre-quantized checkpoint folder)."""
    from transformers import AutoModelForCausalLM

    flag = request.param
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=_bnb_config(KINDS[flag]), dtype=torch.bfloat16,
        device_map="cpu",
    ).eval()
    # Save before any forward: on CPU bitsandbytes repacks 4-bit weights for its kernel then.
    saved = tmp_path_factory.mktemp("bnb-saved") / flag
    model.save_pretrained(saved)
    for item in base.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(item, saved / item.name)
    record = next(
        r for seed in range(1000)
        if (r := greedy_record(lambda ids: model(input_ids=ids).logits, seed)) is not None
    )
    record["tokens"], record["logits"] = map(torch.as_tensor, cached_greedy(
        model, record["prompt"].tolist()))
    return flag, record, saved


def test_quantized_at_load_matches_transformers(case, base: Path) -> None:
    flag, record, _ = case
    engine = make_engine(base, quantize=flag)
    tokens, logits = native_greedy(engine, record["prompt"].tolist())
    assert_close_greedy(tokens, logits, record["tokens"].tolist(), record["logits"],
                        LOGIT_TOLERANCE)
    assert engine.loaded.quantization.startswith(f"bitsandbytes {KINDS[flag]}")
    # bitsandbytes' CPU LLM.int8 dequantizes instead of quantizing activations in training
    # mode: every module swapped in at load must be in eval mode, as transformers' are.
    assert not any(m.training for m in engine.loaded.model.modules())


def test_prequantized_checkpoint_matches_transformers(case) -> None:
    flag, record, saved = case
    engine = make_engine(saved)
    assert "pre-quantized" in engine.loaded.quantization
    tokens, logits = native_greedy(engine, record["prompt"].tolist())
    assert_close_greedy(tokens, logits, record["tokens"].tolist(), record["logits"],
                        LOGIT_TOLERANCE)


def test_4bit_linears_take_at_most_035x_bf16(base: Path) -> None:
    engine = make_engine(base, quantize="bitsandbytes-nf4")
    ratio = quantized_linear_bytes(engine) / dense_linear_bytes(engine.loaded.hf_config)
    assert ratio <= 0.35, ratio
