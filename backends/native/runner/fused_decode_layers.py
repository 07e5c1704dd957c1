"""Every decoder layer of a decode step in one C++ call, for Llama-shaped models (Llama's own
layer, and Qwen3's with its per-head q / k norm) whose layers our kernels cover whole: float32
with all linears our 4-bit int8-dot weights (the default model's GGUF path;
`switchyard_cpu::q4_decode_layers`, backends/cpu_kernels/decode_layers.cpp) or bf16 with all
linears on our bf16 kernel (`switchyard_cpu::bf16_decode_layers`, bf16_decode_layers.cpp).
The compiled layer region spent ~1.5 ms of the default model's ~10 ms batch-1 step between
its kernels (the graph's Python wrapper, small inductor kernels and dispatcher calls a layer),
~1.5 ms of W1's 16-row bf16 step; these run the same kernels back to back.
`fused_decode_layers` says None for any model neither covers, and the compiled region runs as
before.
"""

from __future__ import annotations

import torch
from torch import nn

from backends.native.layers.attention import DecodeMetadata, KVCache
from backends.native.layers.cpu_linear import PrepackedLinear
from backends.native.models.llama import LlamaDecoderLayer, RMSNorm
from backends.native.models.qwen3 import Qwen3DecoderLayer
from backends.quantized.int4_linear import INT8_DOT_DENSE_MIN_ROWS, INT8_DOT_FINE, Int4Linear

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
# A layer's modules, all of them: anything more (a bias is a parameter, checked on the linears)
# is not in the C++ layer.
LAYER_MODULES = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm", *LINEARS}
# The layer classes the C++ layers run, with their modules; Qwen3's per-head q / k norms are
# the kernels' `qk_norm`. By exact type: the MoE models' layers (subclasses, their `mlp` a
# sparse block, models/moe.py) are declined.
COVERED_LAYERS = {LlamaDecoderLayer: LAYER_MODULES,
                  Qwen3DecoderLayer: LAYER_MODULES | set(QK_NORMS)}


def fused_decode_layers(
    model: nn.Module, kv_cache: KVCache,
) -> FusedDecodeLayers | Bf16DecodeLayers | None:
    """The C++ layers that cover this model, or None."""
    return FusedDecodeLayers.of(model, kv_cache) or Bf16DecodeLayers.of(model, kv_cache)


def _covered_linear(module: nn.Module, group_size: int) -> bool:
    return (isinstance(module, Int4Linear) and module.kernel == "cpu-int8-dot"
            and module.perm is None and module.repeats == 1 and module.bias is None
            and module.group_size == group_size and module.dtype == torch.float32)


def _norms(layer: nn.Module) -> list[nn.Module]:
    """Every RMSNorm the C++ layer applies: the two of the residual stream, and q / k's."""
    names = ("input_layernorm", "post_attention_layernorm", *_qk_norm_names(layer))
    return [layer.get_submodule(name) for name in names]


def _qk_norm_names(layer: nn.Module) -> tuple[str, ...]:
    return QK_NORMS if type(layer) is Qwen3DecoderLayer else ()


def _layer_shape(layer: nn.Module, eps: float, dtype: torch.dtype) -> bool:
    """The layer's class and modules are one the C++ layers run, its norms all of `eps` and
    `dtype`, and its attention on our kernel."""
    modules = {name for name, _ in layer.named_modules() if name}
    return (COVERED_LAYERS.get(type(layer)) == modules and layer.self_attn.cpu_kernel
            and all(type(norm) is RMSNorm and norm.eps == eps and norm.weight.dtype == dtype
                    for norm in _norms(layer)))


def _covered_layer(layer: nn.Module, eps: float, group_size: int) -> bool:
    return (_layer_shape(layer, eps, torch.float32)
            and all(_covered_linear(layer.get_submodule(name), group_size) for name in LINEARS))


class FusedDecodeLayers:
    """Runs a decode step's layers in C++; `rows_fit` says which batch sizes it takes."""

    def __init__(self, layers: nn.ModuleList, kv_cache: KVCache) -> None:
        first = layers[0]
        attention = first.self_attn
        self.heads, self.kv_heads = attention.num_heads, attention.num_kv_heads
        self.scale, self.eps = attention.scale, first.input_layernorm.eps
        self.group_size = attention.qkv_proj.group_size
        self.k_caches, self.v_caches = list(kv_cache.k), list(kv_cache.v)
        self.weights = [tensor for layer in layers for tensor in _layer_weights(layer)]
        self.qk_norm = type(first) is Qwen3DecoderLayer

    @classmethod
    def of(cls, model: nn.Module, kv_cache: KVCache) -> FusedDecodeLayers | None:
        """The C++ layers for this model, or None where it is not covered (or the kernels are
        not built)."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not layers or not hasattr(torch.ops.switchyard_cpu, "q4_decode_layers"):
            return None
        first = layers[0]
        if type(first) not in COVERED_LAYERS or not isinstance(
                first.self_attn.qkv_proj, Int4Linear):
            return None
        eps, group_size = first.input_layernorm.eps, first.self_attn.qkv_proj.group_size
        if kv_cache.k[0].dtype != torch.float32 or not all(
                type(layer) is type(first) and _covered_layer(layer, eps, group_size)
                for layer in layers):
            return None
        return cls(layers, kv_cache)

    @staticmethod
    def rows_fit(rows: int) -> bool:
        return rows < INT8_DOT_DENSE_MIN_ROWS  # where Int4Linear itself runs q4_mm

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: DecodeMetadata) -> torch.Tensor:
        return torch.ops.switchyard_cpu.q4_decode_layers(
            x, cos, sin, meta.slot_blocks, meta.slot_offsets, meta.block_tables, meta.mask,
            self.k_caches, self.v_caches, self.weights, self.heads, self.kv_heads, self.eps,
            self.scale, self.group_size, INT8_DOT_FINE, self.qk_norm)


def _layer_weights(layer: nn.Module) -> list[torch.Tensor]:
    """The 10 tensors a layer hands the C++ op, in its order (then q / k norms: 12)."""
    attention, mlp = layer.self_attn, layer.mlp
    return [layer.input_layernorm.weight.detach(),
            attention.qkv_proj.packed, attention.qkv_proj.scale_zeros,
            attention.o_proj.packed, attention.o_proj.scale_zeros,
            layer.post_attention_layernorm.weight.detach(),
            mlp.gate_up_proj.packed, mlp.gate_up_proj.scale_zeros,
            mlp.down_proj.packed, mlp.down_proj.scale_zeros, *_qk_norm_weights(layer)]


def _qk_norm_weights(layer: nn.Module) -> list[torch.Tensor]:
    return [layer.get_submodule(name).weight.detach() for name in _qk_norm_names(layer)]


def _bf16_linear(module: nn.Module, silu_mul: bool) -> bool:
    return (isinstance(module, PrepackedLinear) and module.kernel == "bf16"
            and module.bias is None and module.fuses_silu_mul == silu_mul)


def _bf16_layer(layer: nn.Module, eps: float) -> bool:
    attention, mlp = layer.self_attn, layer.mlp
    # The kernel's norms run 16 values at a time: the hidden size, and the head size if normed.
    sixteens = layer.input_layernorm.weight.numel() % 16 == 0 and (
        not _qk_norm_names(layer) or attention.head_dim % 16 == 0)
    return (_layer_shape(layer, eps, torch.bfloat16) and sixteens
            and _bf16_linear(attention.qkv_proj, False) and _bf16_linear(attention.o_proj, False)
            and _bf16_linear(mlp.gate_up_proj, True) and _bf16_linear(mlp.down_proj, False))


class Bf16DecodeLayers:
    """Runs a bf16 decode step's layers in C++, at every batch size."""

    def __init__(self, layers: nn.ModuleList, kv_cache: KVCache) -> None:
        attention = layers[0].self_attn
        self.heads, self.kv_heads = attention.num_heads, attention.num_kv_heads
        self.scale, self.eps = attention.scale, layers[0].input_layernorm.eps
        self.k_caches, self.v_caches = list(kv_cache.k), list(kv_cache.v)
        self.weights = [tensor for layer in layers for tensor in (
            layer.input_layernorm.weight.detach(), layer.self_attn.qkv_proj.packed,
            layer.self_attn.o_proj.packed, layer.post_attention_layernorm.weight.detach(),
            layer.mlp.gate_up_proj.packed, layer.mlp.down_proj.packed,
            *_qk_norm_weights(layer))]
        self.qk_norm = type(layers[0]) is Qwen3DecoderLayer

    @classmethod
    def of(cls, model: nn.Module, kv_cache: KVCache) -> Bf16DecodeLayers | None:
        """The C++ layers for this model, or None where it is not covered (or the kernel is
        not built for this CPU)."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        built = getattr(torch.ops.switchyard_cpu, "bf16_decode_layers_built", None)
        if not layers or built is None or not built() or kv_cache.k[0].dtype != torch.bfloat16:
            return None
        first = layers[0]
        if type(first) not in COVERED_LAYERS or not all(
                type(layer) is type(first) and _bf16_layer(layer, first.input_layernorm.eps)
                for layer in layers):
            return None
        return cls(layers, kv_cache)

    @staticmethod
    def rows_fit(rows: int) -> bool:
        return True

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: DecodeMetadata) -> torch.Tensor:
        return torch.ops.switchyard_cpu.bf16_decode_layers(
            x, cos, sin, meta.slot_blocks, meta.slot_offsets, meta.block_tables, meta.mask,
            self.k_caches, self.v_caches, self.weights, self.heads, self.kv_heads, self.eps,
            self.scale, self.qk_norm)
