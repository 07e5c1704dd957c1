"""EngineConfig: the engine's knobs, frozen, with TGI's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a Hugging Face folder, a .gguf file, or "default"
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | bfloat16 | float32 | float16
    device: str = "cpu"
    max_input_tokens: int | None = None  # default: max_total_tokens - 1
    max_total_tokens: int | None = None  # default: min(model context, 4096)
    max_batch_size: int = 64
    max_batch_prefill_tokens: int = 4096
    max_batch_total_tokens: int | None = None  # KV capacity; default from kv_cache_memory
    kv_cache_memory: float = 2 * 1024**3  # bytes (> 1) or a fraction of free memory (<= 1)
    block_size: int = 16
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    bind_threads: bool = False  # pin the engine thread's OpenMP threads to cores 0..n-1
    seed: int = 0
    compile: bool = True  # torch.compile the decode attention kernel
