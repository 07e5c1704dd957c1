"""Resident weight bytes: what a model's weights take in memory, quantized or not; and its
parameter count, as its checkpoint counts them."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def _weight_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Parameters and persistent buffers (RoPE tables and other caches are not weights)."""
    yield from module.parameters()
    for owner in module.modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                yield buffer


def resident_bytes(module: nn.Module) -> int:
    """Bytes of the module's weights, each storage counted once (tied weights are shared),
    plus statistics a quantization library keeps outside parameters (`extra_bytes()`)."""
    seen: set[int] = set()
    total = 0
    for tensor in _weight_tensors(module):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    extra = (getattr(m, "extra_bytes", None) for m in module.modules())
    return total + sum(fn() for fn in extra if fn is not None)


def _linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(out, in) of a linear layer, quantized or not (its packed tensors hold fewer elements)."""
    out, into = getattr(module, "out_features", None), getattr(module, "in_features", None)
    if isinstance(out, int) and isinstance(into, int):
        return out, into
    return None


def parameter_count(module: nn.Module) -> int:
    """The module's parameters: a linear layer's out x in (+ bias) whatever it packs them as,
    any other tensor's elements; a tensor tied to another counted once."""
    seen: set[int] = set()
    skip: list[str] = []  # linear layers counted whole: their inner tensors are not
    total = 0
    for name, owner in module.named_modules():
        if any(name.startswith(prefix) for prefix in skip):
            continue
        shape = _linear_shape(owner)
        if shape is None:
            for tensor in owner.parameters(recurse=False):
                if tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    total += tensor.numel()
            continue
        skip.append(f"{name}.")
        weight = getattr(owner, "weight", None)
        if isinstance(weight, torch.Tensor):
            if weight.data_ptr() in seen:  # tied (an LM head sharing the embeddings)
                continue
            seen.add(weight.data_ptr())
        bias = getattr(owner, "bias", None)
        total += shape[0] * shape[1] + (bias.numel() if isinstance(bias, torch.Tensor) else 0)
    return total
