"""The default model (GGUF, Q4_1), dequantized at load, gives transformers' greedy tokens.

Dequantized, the engine computes what transformers computes (float32, the same weights), so
16 greedy tokens must match exactly. Kept packed, its int4 kernel takes bf16 activations
(15-40x faster than fp32 ones): tests/quantized/test_gguf.py holds that path to measured
logit tolerances against this dequantized model instead.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.llm_engine import LLMEngine

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def test_default_model_first_16_greedy_tokens_match_transformers(default_gguf_path: str) -> None:
    folder, name = os.path.dirname(default_gguf_path), os.path.basename(default_gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ids = tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=False
    )
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    expected = reference.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
        do_sample=False, eos_token_id=None, pad_token_id=0,
    )[0, ids.shape[1]:].tolist()
    del reference

    engine = LLMEngine(EngineConfig(model="default", dtype="float32", quantize="none",
                                    max_total_tokens=512, max_batch_total_tokens=1024))
    prompt_ids = engine.tokenizer.encode_chat(PROMPT)
    assert prompt_ids == ids[0].tolist()
    (seq,) = engine.generate([prompt_ids], SamplingParams(max_tokens=16, temperature=0.0,
                                                          ignore_eos=True))
    assert seq.output_token_ids == expected
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
