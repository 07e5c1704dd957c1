"""EngineConfig: the engine's knobs, frozen, with TGI's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass

from backends.quantized.config import check_kernels_setting


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a Hugging Face folder, a .gguf file, or "default"
    served_model_name: str | None = None
    # generate, or embed: prompts run through the same scheduler and KV cache, and each one's
    # final hidden states are pooled into a vector (native/embedding.py) instead of sampled
    task: str = "generate"
    dtype: str = "auto"  # auto | bfloat16 | float32 | float16
    device: str = "cpu"
    max_input_tokens: int | None = None  # default: max_total_tokens - 1
    max_total_tokens: int | None = None  # default: min(model context, 4096)
    max_batch_size: int = 64
    # None: 512 on CPU with chunked prefill (short prefill waves), else 4096 (TGI's)
    max_batch_prefill_tokens: int = None  # type: ignore[assignment]
    max_batch_total_tokens: int | None = None  # KV capacity; default from kv_cache_memory
    kv_cache_memory: float = 2 * 1024**3  # bytes (> 1) or a fraction of free memory (<= 1)
    block_size: int = 16
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    seed: int = 0
    compile: bool = True  # torch.compile the decode attention kernel
    # decode-only steps through compiled regions (compiled_step.py; needs compile)
    compile_decode_step: bool = True
    # steps with prompt chunks: each layer's work around attention compiled (compiled_prefill.py;
    # needs compile). None: on for dense weights, off for quantized ones (the default GGUF model
    # prefilled 1-4% faster for ~3 s more warm start; W1's dense prefill 6%, for 0.5 s)
    compile_prefill_step: bool | None = None
    # CPU: dense linears through oneDNN with weights prepacked once at load (cpu_linear.py)
    prepack_weights: bool = True
    # CPU, prepacked bf16 weights: our linear kernel where the CPU has AVX-512-BF16
    # (cpu_kernels/bf16_linear.cpp; at least oneDNN's speed at every row count); False: oneDNN
    bf16_linear_kernel: bool = True
    # CPU, prepacked float32 weights: our AVX2 FMA linear kernel where our kernels run AVX2 code
    # (cpu_kernels/f32_linear.cpp; 0.64-0.92x oneDNN's time at 1-2048 rows there); False: oneDNN
    f32_linear_kernel: bool = True
    # CPU, a bf16 lm_head on our kernel: steps whose rows are all plain greedy take each token
    # from an int8 bound and a few exact logits (greedy_head.py; the full logits' argmax, at
    # ~0.6x the lm_head's time for an int8 copy and a row-major copy of its weight); False: off
    greedy_head: bool = True
    # CPU, with compile: decode and prompt attention through our C++ kernels (cpu_kernels/
    # paged_attention.cpp, prefill_attention.cpp) where they are built and fit the shapes;
    # False: inductor's code for the decode reductions, torch's SDPA for prompts
    attention_kernels: bool = True
    max_concurrent_requests: int = 128  # admission: beyond it, 429 at once
    # Waiting beyond the running batch (admitted, not yet scheduled): beyond these, 429 with a
    # Retry-After from the measured drain rate. None: unbounded (max_concurrent_requests only).
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None  # prompt tokens of the requests waiting
    queue_timeout: float | None = None  # seconds a request may wait unscheduled: then 503
    request_timeout: float | None = None  # seconds a request may take in all: then ended
    # Tests only: a step holding one of these request ids raises after the forward pass
    # (the engine copies it into a set that tests may change while it runs).
    fault_request_ids: frozenset[str] = frozenset()
    chunked_prefill: bool = True
    prefix_caching: bool = True
    waiting_served_ratio: float = 1.2  # TGI's join rule when chunked prefill is off
    max_waiting_tokens: int = 20
    # gptq | awq | gguf (as the checkpoint says), eetq | bitsandbytes[-nf4|-fp4] (at load),
    # none (dense; dequantizes a GGUF file at load); None: whatever the checkpoint holds
    quantize: str | None = None
    # GPTQ / AWQ kernels: auto (gptqmodel's on CUDA when installed and one fits the layout,
    # else native; native on CPU), native (backends/quantized), gptqmodel (forced, CPU too)
    quantized_kernels: str = "auto"
    # the startup cache (GGUF metadata, tokenizer, packed weights; torch.compile's artifacts);
    # None or "none": off. Served models default to ~/.cache/switchyard (backends/registry.py).
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        check_kernels_setting(self.quantized_kernels)
        if self.task not in ("generate", "embed"):
            raise ValueError(f"task {self.task!r} is not generate or embed")
        if self.max_batch_prefill_tokens is None:
            object.__setattr__(self, "max_batch_prefill_tokens", default_prefill_tokens(
                self.device, self.chunked_prefill))
        for name in ("max_queued_requests", "max_queued_tokens"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("queue_timeout", "request_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 seconds")


def default_prefill_tokens(device: str, chunked_prefill: bool) -> int:
    """Prompt tokens per step when not set: on CPU with chunked prefill 512, so that prompts
    arriving together get their first tokens in short waves (a float32 step of 2048 W1 tokens
    held every stream for ~2.5 s on 2 AVX2 cores; 512 cut the x64 TTFT p50 by a quarter at
    the same throughput); unchunked, a step must hold a whole prompt: TGI's 4096."""
    return 512 if device == "cpu" and chunked_prefill else 4096
