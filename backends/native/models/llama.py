"""Llama family (Llama, Mistral, Qwen2, SmolLM2) over the paged KV cache.

Module names follow Hugging Face; q/k/v and gate/up are fused at load time
(`MERGES`), RoPE is rotate-half.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from backends.native.layers.attention import (
    AttentionMetadata,
    DecodeMetadata,
    KVCache,
    paged_attention,
)
from backends.native.models.support import layer_windows, rope_type

if TYPE_CHECKING:
    from backends.quantized.loading import QuantizedLinears

# checkpoint name fragment -> (fused parameter fragment, shard index)
MERGES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class FusedLinear(nn.Module):
    """One matmul for several projections; `shards` are their output sizes in order."""

    def __init__(self, in_features: int, shards: list[int], bias: bool,
                 feeds_silu_mul: bool = False) -> None:
        super().__init__()
        self.shards = shards
        self.feeds_silu_mul = feeds_silu_mul  # [gate, up]: a packed kernel may fuse the two
        self.weight = nn.Parameter(torch.empty(sum(shards), in_features))
        self.bias = nn.Parameter(torch.zeros(sum(shards))) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def load_shard(self, name: str, index: int, tensor: torch.Tensor) -> None:
        start = sum(self.shards[:index])
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError("checkpoint has a bias the config does not declare")
        expected = (self.shards[index],) + tuple(target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"shape {tuple(tensor.shape)} != expected {expected}")
        with torch.no_grad():
            target[start : start + self.shards[index]].copy_(tensor)


class Rotary(nn.Module):
    """cos/sin tables for every position, computed once (float32, then cast)."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        with torch.device("cpu"):  # also when the model is built on the meta device
            cos, sin = self.tables(config, head_dim, max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(
        self, config: PretrainedConfig, head_dim: int, max_positions: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [max_positions, head_dim], float32."""
        inv_freq, scaling = _rope_init(config, head_dim)
        cos, sin = rotary_tables(inv_freq, scaling, torch.arange(max_positions))
        assert cos.shape[-1] == head_dim
        return cos, sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        cos, sin = self.cos[positions], self.sin[positions]
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def rotary_tables(
    inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [len(positions), 2 * len(inv_freq)] (float32), as transformers computes them."""
    freqs = torch.outer(positions.float(), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def _rope_init(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale, as transformers computes them."""
    kind = rope_type(config)
    if kind != "default":
        return ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    base = config.rope_parameters["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[-x2, x1] for x = [x1, x2]: the two halves swapped (a flip of a size-2 dim) times a
    sign, exact as the negation is. Inductor fuses it into the rotary's one loop and keeps
    the halves' elements contiguous, so the loop stays vectorized: a roll (a gather per
    element) took 2.7x its time at 576 rows, a cat of the halves 1.3x and four more loops."""
    half = x.shape[-1] // 2
    sign = torch.tensor([-1.0, 1.0], dtype=x.dtype, device=x.device).view(2, 1)
    return (x.unflatten(-1, (2, half)).flip(-2) * sign).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.cpu_kernel = False  # attention through our C++ kernels (set at load)
        self.window = 0  # sliding window in positions, 0: full attention (set per layer)
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        kv_size = self.num_kv_heads * head_dim
        self.qkv_proj = FusedLinear(
            config.hidden_size, [self.num_heads * head_dim, kv_size, kv_size], qkv_bias
        )
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        self.o_proj = nn.Linear(self.num_heads * head_dim, config.hidden_size, bias=o_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata | DecodeMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.cpu_kernel,
                              window=self.window)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, KVH, D] rotated, v [T, KVH, D]."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shards, dim=-1)
        q = apply_rotary(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, v.view(t, self.num_kv_heads, self.head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = FusedLinear(config.hidden_size, [size, size], bias=False,
                                        feeds_silu_mul=True)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.gate_up_proj, "fuses_silu_mul", False):  # cpu_linear.PrepackedLinear
            return self.down_proj(self.gate_up_proj.silu_mul(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, head_dim)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata | DecodeMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    # The layer in two halves around its attention, for steps that compile them
    # (compiled_prefill.py): the same operations as forward, in the same order.
    def before_attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def after_attention(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.o_proj(attention.reshape(x.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(
        self, config: PretrainedConfig, head_dim: int, max_positions: int,
        layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer,
        rotary_class: type[Rotary] = Rotary,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            layer_class(config, head_dim) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = rotary_class(config, head_dim, max_positions)


class LlamaForCausalLM(nn.Module):
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer
    rotary_class: type[Rotary] = Rotary

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.model = LlamaModel(config, self.head_dim, max_positions, self.layer_class,
                                self.rotary_class)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for layer, window in zip(self.model.layers, layer_windows(config), strict=True):
            layer.self_attn.window = window

    @property
    def num_kv_heads(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
        meta: AttentionMetadata, logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Returns float32 logits for the rows in `logits_indices` only."""
        return self.head_logits(self.hidden(input_ids, positions, kv_cache, meta,
                                            logits_indices))

    def hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
        meta: AttentionMetadata, rows: torch.Tensor,
    ) -> torch.Tensor:
        """The final hidden states (after the final norm) of the rows in `rows` only: the
        lm_head's input, and an embedding model's token states."""
        x, cos, sin = self.embed(input_ids, positions)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, kv_cache.k[i], kv_cache.v[i], meta)
        return self.final_hidden(x.index_select(0, rows))

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first layer's input and the rotary cos / sin of `positions`."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, x.dtype)
        return x, cos, sin

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the last layer's output rows."""
        return self.head_logits(self.final_hidden(x))

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The lm_head's input (the greedy head takes it in place of the logits)."""
        return self.model.norm(x)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def quantizable_linears(self, include_lm_head: bool = False) -> dict[str, list[str]]:
        """Module name -> the checkpoint prefixes it is read from (in shard order)."""
        fused: dict[str, list[str]] = {}
        for fragment, (target, index) in MERGES.items():
            fused.setdefault(target, []).insert(index, fragment)
        targets: dict[str, list[str]] = {}
        for i in range(len(self.model.layers)):
            for block, names in (("self_attn", ("qkv_proj", "o_proj")),
                                 ("mlp", ("gate_up_proj", "down_proj"))):
                for name in names:
                    prefix = f"model.layers.{i}.{block}"
                    targets[f"{prefix}.{name}"] = [
                        f"{prefix}.{part}" for part in fused.get(name, [name])
                    ]
        if include_lm_head:
            targets["lm_head"] = ["lm_head"]
        return targets

    def load_weights(
        self, tensors: Iterable[tuple[str, Any]], quantized: QuantizedLinears | None = None,
    ) -> None:
        """Copy checkpoint tensors in; those of quantized Linears go to `quantized`."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in tensors:
            if quantized is not None and quantized.claims(name):
                quantized.add(name, tensor)
                continue
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            loaded.add(self._load_one(params, name, tensor))
        if quantized is not None:
            quantized.finish()
        missing = [n for n in params if not self._is_loaded(n, loaded)]
        if self.tie_word_embeddings and "lm_head.weight" in missing:
            missing.remove("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {sorted(missing)[:5]}")

    def _is_loaded(self, name: str, loaded: set[str]) -> bool:
        module = self.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, FusedLinear):
            return all(f"{name}#{i}" in loaded for i in range(len(module.shards)))
        return name in loaded

    def _load_one(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str:
        for fragment, (fused, index) in MERGES.items():
            if f".{fragment}." in name:
                fused_name = name.replace(fragment, fused)
                module = self.get_submodule(fused_name.rsplit(".", 1)[0])
                try:
                    module.load_shard(name.rsplit(".", 1)[1], index, tensor)
                except ValueError as e:
                    raise ValueError(f"tensor {name}: {e}") from None
                return f"{fused_name}#{index}"
        if name not in params:
            raise ValueError(f"checkpoint tensor {name} has no place in the model")
        expected = tuple(params[name].shape)
        if expected != tuple(tensor.shape):
            raise ValueError(f"tensor {name}: shape {tuple(tensor.shape)} != expected {expected}")
        with torch.no_grad():
            params[name].copy_(tensor)
        return name
