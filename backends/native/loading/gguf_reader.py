"""GGUF files: a transformers config from the metadata, and dequantized tensors under HF names.

llama.cpp's converter permutes the rows of llama's q/k projections (for its interleaved RoPE;
qwen2 and qwen3 are written as they are); we undo that exactly as transformers' own GGUF loader
does, so the weights match `from_pretrained`. phi3's attn_qkv and ffn_up (gate then up) come
fused, as in its checkpoints (models/phi3.py splits them); its LongRoPE factors, tensors here,
go into the config. gemma3's norm weights come with the 1 of Gemma's `(1 + weight)` added
(its converter adds it); we take it off again. Mixture-of-experts files (qwen3moe, olmoe,
llama with experts: Mixtral) are gguf_experts.py's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize

from backends.native.loading.gguf_experts import (
    ROUTER,
    ROUTER_NAMES,
    expert_hf_name,
    expert_weights,
    is_expert_tensor,
    is_moe,
    moe_config,
    refuse_variants,
)
from backends.native.loading.gguf_rope import ROPE_FREQS, llama3_rope_scaling
from backends.native.models.support import UnsupportedModelError
from backends.quantized.gguf import KEPT_TYPES, GGUFRaw

SUPPORTED_ARCHITECTURES = ("gemma3", "llama", "olmoe", "phi3", "qwen2", "qwen3", "qwen3moe")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BIAS_NAMES = {  # qwen2 only
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_QK_NORM_NAMES = {  # qwen3 only
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_PHI3_NAMES = {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
_GEMMA3_NAMES = {
    **_QK_NORM_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_ARCH_NAMES = {"qwen2": _BIAS_NAMES, "qwen3": _QK_NORM_NAMES, "phi3": _PHI3_NAMES,
               "gemma3": _GEMMA3_NAMES, "llama": {ROUTER: ROUTER_NAMES["llama"]},
               "qwen3moe": {**_QK_NORM_NAMES, ROUTER: ROUTER_NAMES["qwen3moe"]},
               "olmoe": {**_QK_NORM_NAMES, ROUTER: ROUTER_NAMES["olmoe"]}}
GEMMA3_SWA_PATTERN = 6  # llama.cpp's default: every sixth layer global
GEMMA3_SWA_BASE = 10000.0  # llama.cpp's default rotary base of the local layers
_ROPE_FACTORS = {"long_factor": "rope_factors_long.weight",
                 "short_factor": "rope_factors_short.weight"}  # phi3: config, not weights
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def open_gguf(path: str) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"Cannot read GGUF file {path}: {exc}") from exc


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None or not field.types:
        return default
    return field.contents()


def scalar_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every non-array metadata field (the token lists and merges are left out)."""
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if field.types and field.types[0] != GGUFValueType.ARRAY
    }


def gguf_architecture(reader: GGUFReader) -> str:
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported by the native engine "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); use --backend transformers."
        )
    return arch


def gguf_config(reader: GGUFReader) -> transformers.PretrainedConfig:
    """The transformers config (LlamaConfig, Qwen3Config, ...) built from the GGUF metadata."""
    arch = gguf_architecture(reader)
    names = {t.name for t in reader.tensors}

    def meta(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{key}", default)

    moe = is_moe(arch, meta)
    if moe:
        refuse_variants(arch, meta, names)
    _refuse_unknown_tensors(arch, names, moe)

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    rope_dim = int(meta("rope.dimension_count", head_dim))
    if rope_dim != head_dim and arch != "phi3":
        raise UnsupportedModelError(
            f"GGUF partial rotary embedding (rope.dimension_count={rope_dim}, "
            f"head_dim={head_dim}) is not supported."
        )
    kwargs: dict[str, Any] = {
        "vocab_size": _vocab_size(reader, meta("vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field_value(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": field_value(reader, "tokenizer.ggml.padding_token_id"),
    }
    if ROPE_FREQS in names:  # Llama 3's scaling: a factor a frequency, not metadata
        by_name = {t.name: t for t in reader.tensors}
        kwargs["rope_scaling"] = llama3_rope_scaling(
            dequantize_tensor(by_name[ROPE_FREQS]), kwargs["rope_theta"], rope_dim,
            kwargs["max_position_embeddings"])
    if moe:
        return moe_config(arch, meta, kwargs, head_dim, names)
    if arch == "phi3":
        return _phi3_config(reader, meta, kwargs, rope_dim / head_dim)
    if arch == "gemma3":
        return _gemma3_config(meta, kwargs, head_dim)
    if arch == "qwen2":
        return transformers.Qwen2Config(**kwargs)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=head_dim, **kwargs)
    return transformers.LlamaConfig(head_dim=head_dim, **kwargs)


def config_from_dict(raw: dict[str, Any]) -> transformers.PretrainedConfig:
    """The config `gguf_config` built, from its `to_dict()` (as the startup cache keeps it).
    The concrete classes: transformers' AutoConfig machinery costs seconds to import."""
    classes = {"gemma3_text": transformers.Gemma3TextConfig,
               "llama": transformers.LlamaConfig, "phi3": transformers.Phi3Config,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
               "qwen3_moe": transformers.Qwen3MoeConfig, "olmoe": transformers.OlmoeConfig,
               "mixtral": transformers.MixtralConfig}
    return classes[raw["model_type"]].from_dict(raw)


def _phi3_config(
    reader: GGUFReader, meta: Any, kwargs: dict[str, Any], partial_rotary_factor: float,
) -> transformers.Phi3Config:
    """llama.cpp's phi3 metadata: LongRoPE factors as tensors, a window of 0 for none."""
    original = meta("rope.scaling.original_context_length")
    if original is not None:
        kwargs["original_max_position_embeddings"] = int(original)
    by_name = {t.name: t for t in reader.tensors}
    if all(name in by_name for name in _ROPE_FACTORS.values()):
        scaling: dict[str, Any] = {"rope_type": "longrope"}
        for key, name in _ROPE_FACTORS.items():
            scaling[key] = dequantize_tensor(by_name[name]).flatten().tolist()
        attn_factor = meta("rope.scaling.attn_factor")
        if attn_factor is not None:
            scaling["attention_factor"] = float(attn_factor)
        kwargs["rope_scaling"] = scaling
    window = int(meta("attention.sliding_window", 0) or 0)
    return transformers.Phi3Config(
        partial_rotary_factor=partial_rotary_factor, sliding_window=window or None, **kwargs)


def _gemma3_config(meta: Any, kwargs: dict[str, Any],
                   head_dim: int) -> transformers.Gemma3TextConfig:
    """llama.cpp's gemma3 metadata: a window (0 or none: every layer global), its pattern (an
    array of per-layer flags, or every n-th layer global), the local layers' rotary base, and
    the attention scale it derives from the shapes (the 62-layer 27B: hidden / heads)."""
    layers = kwargs["num_hidden_layers"]
    window = int(meta("attention.sliding_window", 0) or 0)
    pattern = meta("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    if not window:
        sliding = [False] * layers
    elif isinstance(pattern, list):
        sliding = [bool(flag) for flag in pattern][:layers]
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    scalar = (kwargs["hidden_size"] // kwargs["num_attention_heads"] if layers == 62
              else head_dim)
    softcap = meta("final_logit_softcapping")
    return transformers.Gemma3TextConfig(
        head_dim=head_dim, query_pre_attn_scalar=scalar, sliding_window=window or None,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_local_base_freq=float(meta("rope.freq_base_swa", GEMMA3_SWA_BASE)),
        final_logit_softcapping=None if softcap is None else float(softcap),
        hidden_activation="gelu_pytorch_tanh", **kwargs)


def gguf_extra_eos_ids(reader: GGUFReader) -> list[int]:
    """End-of-turn tokens llama.cpp also stops on (EOT, EOM), when the file declares them."""
    keys = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return [int(v) for v in (field_value(reader, k) for k in keys) if v is not None]


def _vocab_size(reader: GGUFReader, declared: Any) -> int:
    if declared is not None:
        return int(declared)
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return int(embd.shape[-1])


def _rope_scaling(meta: Any) -> dict[str, Any] | None:
    kind = meta("rope.scaling.type", "none")
    factor = meta("rope.scaling.factor")
    if kind == "none" or factor is None or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        original = meta("rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise UnsupportedModelError(f"GGUF rope.scaling.type {kind!r} is not supported.")


def hf_name(arch: str, gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match is None:
        return None
    layer, rest = match.groups()
    suffix = _ARCH_NAMES.get(arch, {}).get(rest) or _BLOCK_NAMES.get(rest)
    return expert_hf_name(arch, gguf_name) if suffix is None else f"model.layers.{layer}.{suffix}"


def _refuse_unknown_tensors(arch: str, names: set[str], moe: bool) -> None:
    """Refuse tensors with no HF name; routers and experts belong to MoE files only."""

    def known(name: str) -> bool:
        if _config_only(arch, name):
            return True
        if is_expert_tensor(name) or name.endswith(ROUTER) or expert_hf_name(arch, name):
            return moe
        return hf_name(arch, name) is not None

    unknown = sorted(n for n in names if not known(n))
    if unknown:
        shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        raise UnsupportedModelError(
            f"GGUF file has tensors the native engine does not know how to use: {shown}"
        )


def check_tensor_types(reader: GGUFReader) -> None:
    """Refuse, at load, any tensor whose quantization type gguf cannot dequantize."""
    checked: set[GGMLQuantizationType] = set()
    for tensor in reader.tensors:
        if tensor.tensor_type in checked:
            continue
        try:
            dequantize(tensor.data[:1], tensor.tensor_type)
        except NotImplementedError as exc:
            kind = getattr(tensor.tensor_type, "name", tensor.tensor_type)
            raise UnsupportedModelError(
                f"GGUF tensor {tensor.name} has quantization type {kind}, "
                "which cannot be dequantized."
            ) from exc
        checked.add(tensor.tensor_type)


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """The tensor as float32 in torch's dimension order ([out_features, in_features])."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise UnsupportedModelError(
            f"GGUF tensor {tensor.name}: cannot dequantize type {tensor.tensor_type!r}"
        ) from exc
    array = np.array(values, dtype=np.float32, copy=True).reshape(shape)
    return torch.from_numpy(array)


def reverse_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `reshape(n_head, 2, d, ...).swapaxes(1, 2)` on q/k rows."""
    dim = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, dim, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


def raw_tensor(tensor: ReaderTensor) -> GGUFRaw:
    """A tensor's blocks as stored, one row per output feature (no dequantization)."""
    rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
    data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True)).view(rows, -1)
    return GGUFRaw(tensor.name, tensor.tensor_type, data, int(tensor.shape[0]))


def lm_head_kept(reader: GGUFReader) -> bool:
    """Is the lm_head's tensor (output.weight, else the tied token_embd) of a kept type?"""
    by_name = {t.name: t for t in reader.tensors}
    head = by_name.get("output.weight") or by_name.get("token_embd.weight")
    return head is not None and head.tensor_type in KEPT_TYPES


def _config_only(arch: str, gguf_name: str) -> bool:
    return ((arch == "phi3" and gguf_name in _ROPE_FACTORS.values())
            or (arch == "llama" and gguf_name == ROPE_FREQS))


def _is_linear(name: str) -> bool:
    return name == "lm_head.weight" or name.endswith("_proj.weight") or ".experts." in name


def iter_gguf_tensors(
    reader: GGUFReader, config: transformers.PretrainedConfig, keep_quantized: bool = False,
) -> Iterator[tuple[str, torch.Tensor | GGUFRaw]]:
    """(HF name, float32 tensor), or with `keep_quantized` Linear weights of a kept type as
    `GGUFRaw`; a tied lm_head then also comes as "lm_head.weight" from token_embd's blocks."""
    arch = gguf_architecture(reader)
    tie_raw = keep_quantized and config.tie_word_embeddings and lm_head_kept(reader)
    for tensor in reader.tensors:
        if _config_only(arch, tensor.name):
            continue
        if is_expert_tensor(tensor.name):
            yield from expert_weights(tensor, arch, keep_quantized)
            continue
        name = hf_name(arch, tensor.name)
        if name is None:
            raise UnsupportedModelError(f"Unknown GGUF tensor {tensor.name}")
        if tie_raw and tensor.name == "token_embd.weight":
            yield "lm_head.weight", raw_tensor(tensor)
        weight: torch.Tensor | GGUFRaw
        if keep_quantized and _is_linear(name) and tensor.tensor_type in KEPT_TYPES:
            weight = raw_tensor(tensor)
        else:
            weight = dequantize_tensor(tensor)
        if arch == "gemma3" and name.endswith("norm.weight"):
            weight = weight - 1.0  # norms are never kept quantized: a float32 tensor
        if arch == "llama" and name.endswith("q_proj.weight"):
            weight = _permute_rows(weight, config.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            weight = _permute_rows(weight, config.num_key_value_heads)
        yield name, weight


def _permute_rows(weight: torch.Tensor | GGUFRaw, n_head: int) -> torch.Tensor | GGUFRaw:
    """reverse_permute on whole rows: GGUF blocks never cross rows, so raw rows move alike."""
    if isinstance(weight, torch.Tensor):
        return reverse_permute(weight, n_head)
    rows = reverse_permute(torch.arange(weight.data.shape[0]), n_head)
    return weight.rows(rows)
