"""Routing checkpoint tensors to quantized Linears while a model loads.

`prepare_model` swaps the model's quantizable Linears for `PendingLinear` placeholders (before
the dense parameters are materialized, so no dense copy of them is ever allocated) and
returns a `QuantizedLinears`. The model's `load_weights` hands it every tensor that belongs to
one of those Linears; as soon as a Linear has all its tensors it is built and put in place.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from backends.quantized.awq import AWQWeightsLoader
from backends.quantized.config import (
    AWQConfig,
    BnbConfig,
    EETQConfig,
    GGUFConfig,
    GPTQConfig,
    QuantConfig,
    QuantizationError,
    check_kernels_setting,
)
from backends.quantized.eetq import EETQWeightsLoader
from backends.quantized.gptq import GPTQWeightsLoader
from backends.quantized.linear import LinearSpec, Parts, PendingLinear, WeightsLoader

log = logging.getLogger(__name__)
_MAX_SUFFIX_DEPTH = 3  # "weight.quant_state.bitsandbytes__nf4" is 3 components deep


def weights_loader(config: QuantConfig, kernels: str = "auto") -> WeightsLoader:
    """`kernels` (--quantized-kernels) chooses between gptqmodel's and the native kernels for
    GPTQ / AWQ; the other formats have one set of kernels each."""
    check_kernels_setting(kernels)
    if isinstance(config, GPTQConfig):
        return GPTQWeightsLoader(config, kernels)
    if isinstance(config, AWQConfig):
        return AWQWeightsLoader(config, kernels)
    if isinstance(config, EETQConfig):
        return EETQWeightsLoader(config)
    if isinstance(config, BnbConfig):
        from backends.quantized.bnb import BnbWeightsLoader

        return BnbWeightsLoader(config)
    if isinstance(config, GGUFConfig):
        from backends.quantized.gguf import GGUFWeightsLoader

        return GGUFWeightsLoader(config)
    raise QuantizationError(f"no weights loader for {config!r}")


class QuantizedLinears:
    def __init__(
        self, model: nn.Module, loader: WeightsLoader, specs: list[LinearSpec],
        skip: frozenset[str] = frozenset(), description: str = "",
    ) -> None:
        self.model = model
        self.description = description or loader.method  # LoadedModel.quantization
        self.skip = skip  # checkpoint tensors with no place left (a packed tied embedding)
        self.loader = loader
        self.specs = {spec.name: spec for spec in specs}
        # checkpoint prefix -> (module name, shard index)
        self.prefixes = {
            prefix: (spec.name, i)
            for spec in specs for i, prefix in enumerate(spec.checkpoint_names)
        }
        self.parts: dict[str, list[Parts]] = {
            spec.name: [{} for _ in spec.checkpoint_names] for spec in specs
        }
        self.built: dict[str, nn.Module] = {}
        self.ready: list[str] = []  # complete, built once the stream moves on (late extras)

    def split(self, name: str) -> tuple[str, str] | None:
        """(checkpoint prefix, suffix) if `name` belongs to a quantized Linear, else None."""
        parts = name.split(".")
        for depth in range(1, min(_MAX_SUFFIX_DEPTH, len(parts) - 1) + 1):
            prefix = ".".join(parts[:-depth])
            if prefix in self.prefixes:
                return prefix, ".".join(parts[-depth:])
        return None

    def claims(self, name: str) -> bool:
        return name in self.skip or self.split(name) is not None

    def add(self, name: str, tensor: Any) -> None:
        if name in self.skip:
            return
        split = self.split(name)
        assert split is not None
        prefix, suffix = split
        allowed = (*self.loader.required, *self.loader.optional, "bias")
        if suffix not in allowed:
            raise QuantizationError(
                f"tensor {name} does not belong in a {self.loader.method} checkpoint "
                f"(a linear holds {', '.join(allowed)})"
            )
        module_name, index = self.prefixes[prefix]
        if module_name in self.built:
            raise QuantizationError(f"tensor {name} appears twice in the checkpoint")
        for done in [m for m in self.ready if m != module_name]:
            self._build(done)
        self.parts[module_name][index][suffix] = tensor
        if module_name not in self.ready and self._complete(module_name):
            self.ready.append(module_name)

    def _missing(self, module_name: str) -> list[str]:
        spec = self.specs[module_name]
        wanted = self.loader.required + (("bias",) if spec.bias else ())
        return [
            f"{prefix}.{suffix}"
            for prefix, parts in zip(spec.checkpoint_names, self.parts[module_name], strict=True)
            for suffix in wanted if suffix not in parts
        ]

    def _complete(self, module_name: str) -> bool:
        return not self._missing(module_name)

    def _build(self, module_name: str) -> None:
        self.ready.remove(module_name)
        spec = self.specs[module_name]
        module = self.loader.build(spec, self.parts.pop(module_name))
        parent_name, _, attr = module_name.rpartition(".")
        setattr(self.model.get_submodule(parent_name) if parent_name else self.model, attr, module)
        self.built[module_name] = module

    def finish(self) -> None:
        """Build what is left; raise naming the first missing tensors, if any Linear never got
        all of its own."""
        for done in list(self.ready):
            self._build(done)
        missing = [m for name in self.specs if name not in self.built for m in self._missing(name)]
        if missing:
            shown = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
            raise QuantizationError(
                f"{self.loader.method} checkpoint lacks tensors: {shown}"
            )


def prepare_model(
    model: nn.Module, config: QuantConfig, device: torch.device, dtype: torch.dtype,
    quantized_lm_head: bool = False, quantized_kernels: str = "auto",
) -> QuantizedLinears:
    """Replace the model's quantizable Linears by placeholders; call before materializing.
    `quantized_lm_head`: the lm_head too (GGUF files whose output tensor stays packed).
    `quantized_kernels`: --quantized-kernels (auto | native | gptqmodel)."""
    loader = weights_loader(config, quantized_kernels)
    kernel = loader.kernel(device, dtype)  # a forced kernel that cannot be had fails here
    packed_gguf_head = quantized_lm_head and isinstance(config, GGUFConfig)
    gptq_head = isinstance(config, GPTQConfig) and config.lm_head
    targets = model.quantizable_linears(include_lm_head=packed_gguf_head or gptq_head)
    if isinstance(config, GPTQConfig) and config.dynamic:
        targets = _gptq_quantized(targets, config)
    specs = []
    for name, checkpoint_names in targets.items():
        module = model.get_submodule(name)
        shards = list(getattr(module, "shards", [module.weight.shape[0]]))
        spec = LinearSpec(
            name, checkpoint_names, module.weight.shape[1], shards,
            getattr(module, "bias", None) is not None, device, dtype,
        )
        specs.append(spec)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr,
                PendingLinear(spec))
    log.info("quantization: %s; kernel: %s", config.describe(), kernel)
    # /info names the kernel where --quantized-kernels chooses it (GPTQ, AWQ)
    chosen = isinstance(config, GPTQConfig | AWQConfig)
    description = config.describe() + (f"; kernel: {kernel}" if chosen else "")
    # A GPTQ checkpoint keeps its (tied) embedding dense beside the quantized lm_head.
    skip = _pack_tied_embedding(model, device) if packed_gguf_head else frozenset()
    return QuantizedLinears(model, loader, specs, skip, description)


def _gptq_quantized(targets: dict[str, list[str]], config: GPTQConfig) -> dict[str, list[str]]:
    """The Linears the checkpoint's dynamic rules quantize (the others load dense)."""
    kept = {}
    for name, prefixes in targets.items():
        skipped = [config.for_module(prefix) is None for prefix in prefixes]
        if all(skipped):
            continue
        if any(skipped):
            raise QuantizationError(
                f"{name}: quantization_config.dynamic leaves some of {', '.join(prefixes)} "
                "unquantized; the engine runs them as one fused Linear"
            )
        kept[name] = prefixes
    return kept


def _pack_tied_embedding(model: nn.Module, device: torch.device) -> frozenset[str]:
    """With a tied, packed lm_head, token lookups read its rows: no dense table is kept."""
    from backends.quantized.embedding import PackedEmbedding
    from backends.quantized.int4_linear import can_read_rows

    embed = model.model.embed_tokens
    if not getattr(model, "tie_word_embeddings", False) or not can_read_rows(
        embed.num_embeddings, embed.embedding_dim, device
    ):
        return frozenset()
    model.model.embed_tokens = PackedEmbedding(
        lambda: model.lm_head, embed.num_embeddings, embed.embedding_dim
    )
    return frozenset({"model.embed_tokens.weight"})

