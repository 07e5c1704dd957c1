"""Resident weight bytes: what a model's weights take in memory, quantized or not."""

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
