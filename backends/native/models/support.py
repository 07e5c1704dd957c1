"""What the native engine can run: `check_supported` refuses unsupported configs at load, and
`layer_windows` says which layers attend through a sliding window."""

from __future__ import annotations

from typing import Any

MOE_MODEL_TYPES = ("mixtral", "olmoe", "qwen3_moe")  # models/moe.py's sparse block
SUPPORTED_MODEL_TYPES = ("gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3",
                         *MOE_MODEL_TYPES)
# Config fields that ask for shared (always-on) experts beside the routed ones (Qwen2-MoE,
# DeepSeek, Llama 4 ...): the native MoE block has routed experts only.
SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "num_shared_experts",
                        "n_shared_experts", "moe_shared_expert_intermediate_size")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Rotary kinds one architecture's own rotary implements (models/phi3.py: Phi3Rotary).
ARCHITECTURE_ROPE_TYPES = {"phi3": ("default", "longrope")}
SUPPORTED_ACTIVATIONS = {"gemma3_text": ("gelu_pytorch_tanh",)}  # every other: silu only
# Architectures whose transformers code takes each layer's attention from `config.layer_types`
# (the others apply their one `sliding_window`, if any, to every layer).
LAYER_TYPED = ("gemma3_text", "qwen2", "qwen3")
LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelError(ValueError):
    """The checkpoint declares something the native engine does not implement."""


def check_supported(config: Any) -> None:
    """Raise UnsupportedModelError naming the first unsupported feature of `config`."""
    model_type = getattr(config, "model_type", None)
    if model_type == "gemma3":
        raise UnsupportedModelError(
            "Gemma 3 multimodal checkpoints (model_type 'gemma3') are not supported by the "
            "native engine; use a text-only Gemma 3 (gemma3_text) or --backend transformers."
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by the native engine "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use --backend transformers."
        )
    _check_rope_scaling(config)
    act = activation(config)
    allowed = SUPPORTED_ACTIVATIONS.get(model_type, ("silu",))
    if act not in allowed:
        raise UnsupportedModelError(
            f"hidden_act {act!r} is not supported by the native engine for {model_type} "
            f"(only {', '.join(allowed)})."
        )
    if getattr(config, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported by the native engine.")
    if model_type == "phi3" and getattr(config, "quantization_config", None):
        # Its q/k/v and gate/up come fused; the quantized loaders take them one by one.
        raise UnsupportedModelError(
            "Pre-quantized Phi-3 checkpoints (quantization_config) are not supported by the "
            "native engine; use a GGUF file or --backend transformers."
        )
    _check_layer_types(config)
    if model_type in MOE_MODEL_TYPES:
        _check_moe(config)
    if model_type == "gemma3_text":
        _check_gemma3(config)


def activation(config: Any) -> str:
    """The MLP's activation (Gemma names it `hidden_activation`)."""
    return str(getattr(config, "hidden_activation", None)
               or getattr(config, "hidden_act", None) or "silu")


def layer_windows(config: Any) -> list[int]:
    """Each layer's attention window in positions (0: full attention), as transformers applies
    it: from `layer_types` for the architectures that read them (Qwen2 / Qwen3 build them from
    `use_sliding_window` and `max_window_layers`), else one window over every layer."""
    model_type = getattr(config, "model_type", None)
    window = int(getattr(config, "sliding_window", None) or 0)
    if model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        window = 0
    types = getattr(config, "layer_types", None) if model_type in LAYER_TYPED else None
    if types is None:
        return [window] * int(config.num_hidden_layers)
    return [window if kind == "sliding_attention" else 0 for kind in types]


def rope_type(config: Any, layer_type: str | None = None) -> str:
    """The RoPE type of `config` ("default" when it has no scaling); `layer_type`: of that
    kind of layer's own parameters (Gemma 3 keeps one set per kind)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    return str(params.get("rope_type") or params.get("type") or "default")


def _check_rope_scaling(config: Any) -> None:
    model_type = getattr(config, "model_type", None)
    # Gemma 3's global layers take the scaling (its local ones: `_check_gemma3`).
    kind = rope_type(config, "full_attention" if model_type == "gemma3_text" else None)
    supported = ARCHITECTURE_ROPE_TYPES.get(model_type, SUPPORTED_ROPE_TYPES)
    if kind not in supported:
        raise UnsupportedModelError(
            f"rope_scaling type {kind!r} is not supported by the native engine for "
            f"{model_type} (supported: {', '.join(supported)}); use --backend transformers."
        )


def _check_layer_types(config: Any) -> None:
    if getattr(config, "model_type", None) not in LAYER_TYPED:
        return
    types = getattr(config, "layer_types", None) or []
    unknown = sorted({kind for kind in types if kind not in LAYER_TYPES})
    if unknown:
        raise UnsupportedModelError(
            f"layer_types {', '.join(unknown)} are not supported by the native engine "
            f"(only {', '.join(LAYER_TYPES)}); use --backend transformers."
        )
    if len(types) != int(config.num_hidden_layers):
        raise UnsupportedModelError(
            f"layer_types has {len(types)} entries for {config.num_hidden_layers} layers.")


def _check_moe(config: Any) -> None:
    for name in SHARED_EXPERT_FIELDS:
        if getattr(config, name, None):
            raise UnsupportedModelError(
                f"{config.model_type} with {name}={getattr(config, name)!r} (shared experts) is "
                "not supported by the native engine; use --backend transformers."
            )
    experts, top_k = int(config.num_experts or 0), int(config.num_experts_per_tok or 0)
    if config.model_type != "qwen3_moe" and experts == 0:  # Qwen3-MoE: then every layer dense
        raise UnsupportedModelError(
            f"{config.model_type} with num_experts=0 is not supported by the native engine; "
            "use --backend transformers.")
    if experts and not 0 < top_k <= experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok={top_k} with {experts} experts is not supported by the "
            "native engine; use --backend transformers.")
    if config.model_type == "qwen3_moe" and int(getattr(config, "decoder_sparse_step", 1)) < 1:
        raise UnsupportedModelError(
            f"decoder_sparse_step={config.decoder_sparse_step} is not supported by the native "
            "engine; use --backend transformers.")


def _check_gemma3(config: Any) -> None:
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            raise UnsupportedModelError(
                f"Gemma 3 with {name} set is not supported by the native engine; "
                "use --backend transformers."
            )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "Gemma 3 with use_bidirectional_attention=True is not supported by the native "
            "engine; use --backend transformers."
        )
    if rope_type(config, "sliding_attention") != "default":
        raise UnsupportedModelError(
            "Gemma 3 with scaled RoPE on its sliding layers is not supported by the native "
            "engine; use --backend transformers."
        )
