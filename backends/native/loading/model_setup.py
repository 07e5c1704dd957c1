"""From an EngineConfig to a loaded model, tokenizer, limits and a sized KV cache."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from backends.base import NO_SAMPLING_DEFAULTS, SamplingDefaults
from backends.cpu_kernels.build import kernel_status
from backends.cpu_kernels.status import require
from backends.default_model import checkpoint_sampling, resolve_model_path
from backends.machine.cache_dir import cache_root, point_inductor_cache
from backends.machine.cpu_dtype import DtypeChoice, choose_dtype, machine_key
from backends.native.config import EngineConfig
from backends.native.layers.attention import KVCache, attention_kernels_fit
from backends.native.layers.cpu_linear import can_prepack, prepack_linears
from backends.native.loading import weight_cache
from backends.native.loading.embedding_model import decoder_tensors, drop_lm_head
from backends.native.loading.load_progress import current_tracker, tensor_total, weight_progress
from backends.native.loading.loader import Checkpoint, load_checkpoint, weight_files
from backends.native.loading.startup_cache import (
    LoadStages,
    StartupCache,
    open_cache,
)
from backends.native.loading.tokenizer_loading import load_tokenizer
from backends.native.models import build_model, sliding_window
from backends.native.models.moe import SparseMoeBlock, expert_bytes, moe_blocks
from backends.native.models.support import check_supported
from backends.pooling import DECODER_DEFAULT, Pooling, read_pooling
from backends.quantized.config import GGUFConfig, QuantConfig, resolve_quantization
from backends.quantized.gguf import GGUFFormats, gguf_formats
from backends.quantized.loading import QuantizedLinears, prepare_model
from backends.quantized.resident import parameter_count, resident_bytes
from backends.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_TOTAL_TOKENS = 4096


class EngineConfigError(ValueError):
    """A setting that cannot work with this model or this machine."""


@dataclass
class LoadedModel:
    model_path: str
    hf_config: PretrainedConfig
    model: nn.Module
    tokenizer: Tokenizer
    kv_cache: KVCache
    num_blocks: int
    device: torch.device
    dtype: torch.dtype
    sliding_window: int | None  # the sliding layers' window (each layer knows whether it slides)
    max_input_tokens: int
    max_total_tokens: int
    weight_bytes: int  # resident bytes of the weights (quantized ones as packed)
    quantization: str | None = None  # e.g. "gptq 4-bit group 128 sym"; None: dense
    dtype_reason: str = ""  # why this dtype (auto's decision, or a slow explicit one)
    cpu_kernels: str | None = None  # our CPU kernels' variant, or `none (<why>)`; None: GPU
    sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS  # the checkpoint's own
    gguf_formats: GGUFFormats | None = None  # GGUF: the types kept packed, tensors dequantized
    expert_bytes: int = 0  # of weight_bytes, the experts' (mixture-of-experts models)
    moe_blocks: tuple[SparseMoeBlock, ...] = ()  # their MoE layers, for the routing counts
    parameter_count: int = 0  # as the checkpoint counts them (quantized layers unpacked)
    pooling: Pooling | None = None  # an embedding model's (task embed; no lm_head); None: LM


def load_model(config: EngineConfig) -> LoadedModel:
    """Each stage logs its time (`load: weights 0.41s (cached)`); GGUF files keep what is slow
    to rebuild in the startup cache (startup_cache.py)."""
    path = resolve_model_path(config.model)
    log.info("loading %s", path)
    root = cache_root(config.cache_dir)
    point_inductor_cache(root, machine_key())
    cache = open_cache(root, path)
    stages = LoadStages()
    with stages.stage("checkpoint metadata") as stage:
        checkpoint = load_checkpoint(path, cache)
        stage["cached"] = checkpoint.metadata_cached
    check_supported(checkpoint.config)
    hf_config = checkpoint.config
    # An embedding model pools as its sentence-transformers config says (a decoder's default:
    # the last token, normalised); refused here, before the weights, when it cannot.
    pooling = read_pooling(path, DECODER_DEFAULT) if config.task == "embed" else None
    device = torch.device(config.device)
    dtype_choice = resolve_dtype(config.dtype, device)
    dtype = dtype_choice.dtype
    max_input, max_total = resolve_limits(config, hf_config)
    quant = resolve_quantization(hf_config, checkpoint.format, config.quantize)
    # Built (or found) before the weights: `required` fails here, and the weights' cache
    # entry and packing depend on which kernels run.
    cpu_kernels = require(kernel_status()).describe() if device.type == "cpu" else None
    with stages.stage("weights") as stage:
        model, linears, stage["cached"] = _build_and_load(
            config, checkpoint, cache, quant, max_total, device, dtype)
    if config.prepack_weights and can_prepack(device, dtype):
        with stages.stage("prepack weights"):
            prepack_linears(model, bf16_kernel=config.bf16_linear_kernel,
                            f32_kernel=config.f32_linear_kernel)
    if config.attention_kernels and config.compile:
        use_attention_kernels(model, device, dtype, config.block_size)
    with stages.stage("tokenizer") as stage:
        tokenizer = load_tokenizer(checkpoint, cache)
        stage["cached"] = tokenizer.from_cache
    with stages.stage("kv cache"):
        num_blocks, kv_cache = _allocate_kv_cache(config, model, max_total, device, dtype)
    weight_bytes = resident_bytes(model)
    quantization = linears.description if linears else None
    log.info(
        "ready: %.1f MB of weights (%s), %d KV blocks of %d tokens%s",
        weight_bytes / 1e6, quantization or f"dense {dtype}", num_blocks, config.block_size,
        f", cpu_kernels: {cpu_kernels}" if cpu_kernels else "",
    )
    return LoadedModel(
        path, hf_config, model, tokenizer, kv_cache, num_blocks, device, dtype,
        sliding_window(hf_config), max_input, max_total, weight_bytes, quantization,
        dtype_choice.reason, cpu_kernels,
        checkpoint_sampling(config.model, checkpoint.sampling_defaults),
        gguf_formats(model) if isinstance(quant, GGUFConfig) else None, expert_bytes(model),
        tuple(moe_blocks(model)), parameter_count(model), pooling,
    )


def _build_and_load(
    config: EngineConfig, checkpoint: Checkpoint, cache: StartupCache | None,
    quant: QuantConfig | None, max_total: int, device: torch.device, dtype: torch.dtype,
) -> tuple[nn.Module, QuantizedLinears | None, bool]:
    """The model with its weights, and whether they came from the cache (GGUF files only:
    unpacking and repacking their blocks is most of their load)."""
    lm_head = config.task != "embed"

    def build() -> tuple[nn.Module, QuantizedLinears | None]:
        return _build(checkpoint.config, max_total, device, dtype, quant,
                      lm_head and checkpoint.quantized_lm_head, config.quantized_kernels,
                      lm_head)

    model, linears = build()
    entry = None
    if cache is not None and checkpoint.format == "gguf":
        settings = f"{config.quantize}|{config.quantized_kernels}" + ("" if lm_head else "|embed")
        entry = weight_cache.variant(device, dtype, settings)
        found = cache.path(entry).exists()
        def restore(folder: Path) -> bool:
            weight_cache.restore(folder, model, linears, device)
            return True

        if cache.read(entry, restore):
            return model.eval(), linears, True
        if found:  # the damaged entry may have filled part of this skeleton
            model, linears = build()
    log.info("reading weights (%s, %s)", checkpoint.format, dtype)
    _stage_detail(checkpoint, quant)
    tensors = checkpoint.tensors(keep_quantized=isinstance(quant, GGUFConfig))
    if not lm_head:
        tensors = decoder_tensors(tensors)
    model.load_weights(weight_progress(tensors, _tensor_total(checkpoint)), linears)
    model.eval()  # the quantized modules swapped in while loading start in training mode
    if entry is not None:
        cache.publish(entry, lambda folder: weight_cache.save(folder, model, linears))
    return model, linears, False


def _stage_detail(checkpoint: Checkpoint, quant: QuantConfig | None) -> None:
    """What the weights stage does, for /health and /info (reading, and packing if any)."""
    tracker = current_tracker()
    if tracker is not None:
        packing = f", quantizing / packing ({type(quant).__name__})" if quant else ""
        tracker.progress(0.0, f"reading {checkpoint.format}{packing}")


def _tensor_total(checkpoint: Checkpoint) -> int | None:
    files = weight_files(checkpoint.path) if checkpoint.format == "safetensors" else ()
    return tensor_total(checkpoint.path, checkpoint.format, files)


def resolve_dtype(name: str, device: torch.device) -> DtypeChoice:
    """`--dtype` on `device`: auto decides per machine (backends/machine/cpu_dtype.py)."""
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
    if name != "auto" and name not in dtypes:
        raise EngineConfigError(f"--dtype {name!r} is not one of auto, {', '.join(dtypes)}")
    return choose_dtype(dtypes.get(name), device)


def resolve_limits(config: EngineConfig, hf_config: PretrainedConfig) -> tuple[int, int]:
    context = int(getattr(hf_config, "max_position_embeddings", DEFAULT_MAX_TOTAL_TOKENS))
    max_total = config.max_total_tokens or min(context, DEFAULT_MAX_TOTAL_TOKENS)
    if max_total > context:
        raise EngineConfigError(
            f"--max-total-tokens {max_total} exceeds the model's context window ({context})"
        )
    max_input = config.max_input_tokens or max_total - 1
    if max_input >= max_total:
        raise EngineConfigError(
            f"--max-input-tokens ({max_input}) must be < --max-total-tokens ({max_total})"
        )
    if not config.chunked_prefill and config.max_batch_prefill_tokens < max_input:
        raise EngineConfigError(
            f"without chunked prefill --max-batch-prefill-tokens "
            f"({config.max_batch_prefill_tokens}) must be >= --max-input-tokens ({max_input})"
        )
    return max_input, max_total


def use_attention_kernels(
    model: nn.Module, device: torch.device, dtype: torch.dtype, block_size: int,
) -> None:
    """Attention through our C++ kernels in every attention module they fit."""
    for module in model.modules():
        if hasattr(module, "cpu_kernel") and attention_kernels_fit(
                device, dtype, module.num_heads, module.num_kv_heads, module.head_dim,
                block_size):
            module.cpu_kernel = True


def _build(
    hf_config: PretrainedConfig, max_total: int, device: torch.device, dtype: torch.dtype,
    quant: QuantConfig | None = None, quantized_lm_head: bool = False,
    quantized_kernels: str = "auto", lm_head: bool = True,
) -> tuple[nn.Module, QuantizedLinears | None]:
    with torch.device("meta"):
        model = build_model(hf_config, max_total)
    if not lm_head:  # an embedding model
        drop_lm_head(model)
    # Quantized Linears are swapped for placeholders first: no dense copy is ever allocated.
    linears = (prepare_model(model, quant, device, dtype, quantized_lm_head, quantized_kernels)
               if quant else None)
    model = model.to_empty(device=device).to(dtype)
    if getattr(model, "tie_word_embeddings", False) and isinstance(model.lm_head, nn.Linear):
        model.lm_head.weight = model.model.embed_tokens.weight
    # RoPE tables stay float32 (cast per step), as transformers computes them.
    rotary = type(model.model.rotary)  # the architecture's own (Phi-3: partial, LongRoPE)
    model.model.rotary = rotary(hf_config, model.head_dim, max_total).to(device)
    return model, linears


def _allocate_kv_cache(
    config: EngineConfig, model: nn.Module, max_total: int, device: torch.device,
    dtype: torch.dtype,
) -> tuple[int, KVCache]:
    layers = len(model.model.layers)
    per_token = KVCache.bytes_per_token(layers, model.num_kv_heads, model.head_dim, dtype)
    if config.max_batch_total_tokens:
        capacity = config.max_batch_total_tokens
    else:
        capacity = int(_kv_budget_bytes(config.kv_cache_memory, device) // per_token)
    num_blocks = capacity // config.block_size
    if num_blocks * config.block_size < max_total:
        raise EngineConfigError(
            f"the KV cache holds {num_blocks * config.block_size} tokens but one request may "
            f"need --max-total-tokens={max_total}; raise --kv-cache-memory or "
            f"--max-batch-total-tokens, or lower --max-total-tokens"
        )
    cache = KVCache(
        layers, num_blocks, config.block_size, model.num_kv_heads, model.head_dim, dtype, device
    )
    return num_blocks, cache


def _kv_budget_bytes(setting: float, device: torch.device) -> float:
    if setting > 1:
        return setting
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return setting * free
