"""Gemma 3 (text) over the paged KV cache: Llama's layer with

- local layers (a sliding window, their own rotary base `rope_local_base_freq`) interleaved with
  global ones (full attention, `rope_theta` and its scaling), after `config.layer_types`;
- q / k RMSNorm per head (as Qwen3) and the attention scale `query_pre_attn_scalar ** -0.5`;
- RMSNorm times `(1 + weight)`, computed in float32 before the cast back (Llama casts first);
- norms before and after both the attention and the MLP;
- a GeGLU MLP (gelu_pytorch_tanh), and the embeddings scaled by sqrt(hidden) rounded to the
  embedding dtype, as transformers does; the lm_head tied to the embedding table.

The rotary tables hold both bases, [position, 2, head_dim] (0: global, 1: local), and each
layer takes its own: the compiled layer regions still pass one cos / sin pair to every layer.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from backends.native.layers.attention import AttentionMetadata, DecodeMetadata
from backends.native.models.llama import (
    FusedLinear,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    Rotary,
    rotary_tables,
)
from backends.native.models.qwen3 import Qwen3Attention
from backends.native.models.support import rope_type

ROPE_TABLES = ("full_attention", "sliding_attention")  # index into the rotary tables


class Gemma3RMSNorm(nn.Module):
    """RMSNorm with zero-centred weights: x * rsqrt(mean(x^2) + eps) * (1 + w), in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Rotary(Rotary):
    """cos / sin [max_positions, 2, head_dim]: the global layers' table, then the local ones'."""

    def tables(
        self, config: PretrainedConfig, head_dim: int, max_positions: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(max_positions)
        pairs = [rotary_tables(*_inv_freq(config, head_dim, kind), positions)
                 for kind in ROPE_TABLES]
        return (torch.stack([cos for cos, _ in pairs], dim=1),
                torch.stack([sin for _, sin in pairs], dim=1))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin [T, 2, 1, head_dim]: a layer takes `[:, its table]`."""
        cos, sin = self.cos[positions], self.sin[positions]
        return cos.to(dtype).unsqueeze(2), sin.to(dtype).unsqueeze(2)


def _inv_freq(config: PretrainedConfig, head_dim: int, layer_type: str) -> tuple[torch.Tensor,
                                                                                 float]:
    """Inverse frequencies and the cos/sin scale of one kind of layer, as transformers'
    Gemma3RotaryEmbedding computes them."""
    kind = rope_type(config, layer_type)
    if kind != "default":
        return ROPE_INIT_FUNCTIONS[kind](config, "cpu", layer_type=layer_type)
    base = config.rope_parameters[layer_type]["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0


class Gemma3Attention(Qwen3Attention):
    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__(config, head_dim)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.q_norm = Gemma3RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(head_dim, config.rms_norm_eps)
        self.rope_table = 0  # ROPE_TABLES index of this layer's kind (set per layer)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Qwen3's projection with this layer's own rotary table."""
        return super().project(x, cos[:, self.rope_table], sin[:, self.rope_table])


class Gemma3MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        # Not marked for the fused silu kernel: its activation is GELU (tanh).
        self.gate_up_proj = FusedLinear(config.hidden_size, [size, size], bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(LlamaDecoderLayer):
    attention_class = Gemma3Attention

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__(config, head_dim)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = Gemma3RMSNorm(size, eps)
        self.post_attention_layernorm = Gemma3RMSNorm(size, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(size, eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(size, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata | DecodeMetadata,
    ) -> torch.Tensor:
        attention = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
        return self._feed_forward(x + self.post_attention_layernorm(attention))

    def after_attention(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        out = self.self_attn.o_proj(attention.reshape(x.shape[0], -1))
        return self._feed_forward(x + self.post_attention_layernorm(out))

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer
    rotary_class = Gemma3Rotary

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.model.norm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)
        # sqrt(hidden) rounded to each dtype the embeddings may come in, as transformers
        # multiplies by it (on the CPU: built here also when the model is on the meta device)
        scale = torch.tensor(config.hidden_size**0.5, device="cpu")
        self.embed_scales = {dtype: float(scale.to(dtype))
                             for dtype in (torch.float32, torch.bfloat16, torch.float16)}
        for layer, kind in zip(self.model.layers, config.layer_types, strict=True):
            layer.self_attn.rope_table = ROPE_TABLES.index(kind)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, cos, sin = super().embed(input_ids, positions)
        return x * self.embed_scales[x.dtype], cos, sin
