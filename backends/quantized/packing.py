"""Bit packing shared by the formats: int32 words holding 32 / bits values, low bits first."""

from __future__ import annotations

import torch


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R * 32 / bits, C]: word r holds rows r * per .. r * per + per - 1."""
    mask = (1 << bits) - 1
    values = (packed.unsqueeze(1) >> _shifts(bits, packed.device).view(1, -1, 1)) & mask
    return values.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, C * 32 / bits]: word c holds columns c * per .. + per - 1."""
    mask = (1 << bits) - 1
    values = (packed.unsqueeze(-1) >> _shifts(bits, packed.device)) & mask
    return values.reshape(packed.shape[0], -1).to(torch.uint8)
