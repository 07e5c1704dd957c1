"""Architectures the native engine runs, by Hugging Face `model_type`."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from backends.native.models.llama import LlamaForCausalLM
from backends.native.models.phi3 import Phi3ForCausalLM
from backends.native.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def build_model(config: PretrainedConfig, max_positions: int) -> nn.Module:
    try:
        cls = ARCHITECTURES[config.model_type]
    except KeyError:
        raise ValueError(
            f"model_type {config.model_type!r} is not supported by the native engine "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        ) from None
    return cls(config, max_positions)


def sliding_window(config: PretrainedConfig) -> int | None:
    """Attention window the config asks for, or None for full attention (Mistral's and
    Phi-3's cover every layer)."""
    if config.model_type in ("qwen2", "qwen3") and not getattr(
            config, "use_sliding_window", False):
        return None
    return getattr(config, "sliding_window", None) or None
