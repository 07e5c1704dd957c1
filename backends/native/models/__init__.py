"""Architectures the native engine runs, by Hugging Face `model_type`."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from backends.native.models.gemma3 import Gemma3ForCausalLM
from backends.native.models.llama import LlamaForCausalLM
from backends.native.models.mixtral import MixtralForCausalLM
from backends.native.models.olmoe import OlmoeForCausalLM
from backends.native.models.phi3 import Phi3ForCausalLM
from backends.native.models.qwen3 import Qwen3ForCausalLM
from backends.native.models.qwen3_moe import Qwen3MoeForCausalLM
from backends.native.models.support import layer_windows

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "gemma3_text": Gemma3ForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "mixtral": MixtralForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
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
    """The window of the layers that slide (Mistral's and Phi-3's cover every layer; Gemma 3's
    and Qwen2's some), or None where every layer attends fully (`layer_windows` says which)."""
    return max(layer_windows(config), default=0) or None
