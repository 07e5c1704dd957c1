"""The default model (SmolLM2 Q4_1 GGUF, tied Q8_0 embedding) kept packed: its greedy tokens,
logits and resident bytes, for test_gguf.py. Run as a script (`python -m
tests.quantized.default_model_check OUT DTYPE`) it does so in a process whose torch dispatches
to another instruction set's int4 packing, and saves the result to OUT."""

from __future__ import annotations

import sys

import torch

from backends.cpu_kernels.build import active_variant
from backends.quantized.embedding import PackedEmbedding
from backends.quantized.int4_linear import Int4Linear
from backends.quantized.q8_linear import Q8Linear
from tests.quantized.helpers import make_engine, native_greedy

PROMPT = [{"role": "user", "content": "Name the largest planet in the solar system."}]
# The dense fp32 model's top-2 margins over these steps: 2.98 2.84 1.27 4.57 1.61 4.19 10.7
# 2.89, well above the kept model's logit differences (see test_gguf.py); later steps of this
# prompt come within 0.15, where any rounding may pick the other token.
STEPS = 8


def run(dtype: str, quantize: str | None = None, compile: bool = False) -> dict[str, object]:
    options = {"quantize": quantize} if quantize else {}
    engine = make_engine("default", max_total_tokens=256, dtype=dtype, compile=compile,
                         **options)
    prompt = engine.tokenizer.encode_chat(PROMPT)
    tokens, logits = native_greedy(engine, prompt, steps=STEPS)
    model = engine.loaded.model
    return {
        "tokens": tokens, "logits": logits, "weight_bytes": engine.loaded.weight_bytes,
        "quantization": engine.loaded.quantization,
        "packed": isinstance(model.lm_head, (Int4Linear, Q8Linear))
        and isinstance(model.model.embed_tokens, PackedEmbedding),
        "lm_head": type(model.lm_head).__name__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "kernels": active_variant(),
        "fused": engine.runner.decode_step is not None
        and engine.runner.decode_step.fused_layers is not None,
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    out, dtype = sys.argv[1:3]
    torch.save(run(dtype), out)
