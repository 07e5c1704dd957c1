"""Shared by the tests of a decode step's layers in one C++ call (4-bit float32 and bf16):
the compiled step's input rows, random caches, and a count of the fused layers' calls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from backends.native.layers.attention import KVCache


def decode_rows(positions: list[int], tables: list[list[int]], block: int) -> torch.Tensor:
    """The compiled step's input rows: token, position, cache slot, first position, table."""
    rows = []
    for i, (position, table) in enumerate(zip(positions, tables, strict=True)):
        slot = table[position // block] * block + position % block
        rows.append([100 + 7 * i, position, slot, 0, *table])
    return torch.tensor(rows, dtype=torch.long)


def random_caches(kv_cache: KVCache, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """N(0, 1) K and V caches shaped (and typed) as the engine's."""
    gen = torch.Generator().manual_seed(seed)
    return ([torch.randn(k.shape, generator=gen).to(k.dtype) for k in kv_cache.k],
            [torch.randn(v.shape, generator=gen).to(v.dtype) for v in kv_cache.v])


@contextmanager
def counted_fused_calls(step: Any) -> Iterator[list[int]]:
    """The batch size of each call the decode step makes to its fused layers, while open."""
    calls: list[int] = []
    fused = step.fused_layers

    class Counted:
        rows_fit = staticmethod(fused.rows_fit)

        def __call__(self, *args: torch.Tensor) -> torch.Tensor:
            calls.append(args[0].shape[0])
            return fused(*args)

    step.fused_layers = Counted()
    try:
        yield calls
    finally:
        step.fused_layers = fused
