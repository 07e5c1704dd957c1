"""What the native engine can run: `check_supported` refuses unsupported configs at load."""

from __future__ import annotations

from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "phi3", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Rotary kinds one architecture's own rotary implements (models/phi3.py: Phi3Rotary).
ARCHITECTURE_ROPE_TYPES = {"phi3": ("default", "longrope")}
SUPPORTED_ACTIVATIONS = ("silu",)


class UnsupportedModelError(ValueError):
    """The checkpoint declares something the native engine does not implement."""


def check_supported(config: Any) -> None:
    """Raise UnsupportedModelError naming the first unsupported feature of `config`."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by the native engine "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use the transformers backend."
        )
    _check_rope_scaling(config)
    act = getattr(config, "hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(
            f"hidden_act {act!r} is not supported by the native engine (only silu)."
        )
    if getattr(config, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported by the native engine.")
    if model_type == "phi3" and getattr(config, "quantization_config", None):
        # Its q/k/v and gate/up come fused; the quantized loaders take them one by one.
        raise UnsupportedModelError(
            "Pre-quantized Phi-3 checkpoints (quantization_config) are not supported by the "
            "native engine; use a GGUF file or --backend transformers."
        )
    if model_type in ("qwen2", "qwen3") and getattr(config, "use_sliding_window", False):
        # Their window covers only the layers from max_window_layers on; the engine's one
        # window (Mistral's) covers every layer.
        raise UnsupportedModelError(
            f"{model_type.capitalize()} with use_sliding_window=True is not supported by the "
            "native engine; use --backend transformers."
        )


def rope_type(config: Any) -> str:
    """The RoPE type of `config` ("default" when it has no scaling)."""
    params = getattr(config, "rope_parameters", None) or {}
    return str(params.get("rope_type") or params.get("type") or "default")


def _check_rope_scaling(config: Any) -> None:
    kind = rope_type(config)
    model_type = getattr(config, "model_type", None)
    supported = ARCHITECTURE_ROPE_TYPES.get(model_type, SUPPORTED_ROPE_TYPES)
    if kind not in supported:
        raise UnsupportedModelError(
            f"rope_scaling type {kind!r} is not supported by the native engine for "
            f"{model_type} (supported: {', '.join(supported)}); use --backend transformers."
        )
