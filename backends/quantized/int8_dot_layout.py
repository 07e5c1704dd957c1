"""The int8-dot kernels' weight layout (see kernel.cpp): 4-bit values of 16 output rows and 8
input columns in 64 bytes, and float16 scales and zeros per group for the same 16 rows.

    packed      uint8   [N / 16, K / 8, 16, 4]: lane l, byte j: q[16 b + l, 8 t + j] (low
                        nibble) and q[16 b + l, 8 t + 4 + j] (high nibble)
    scale_zero  float16 [N / 16, K / group, 2, 16]: w = q * scale + zero
"""

from __future__ import annotations

import torch

LANES = 16  # output rows of a packed block
BLOCK = 32  # input columns of one activation scale


def fits(out_features: int, in_features: int, group_size: int) -> bool:
    return (out_features % LANES == 0 and in_features % BLOCK == 0
            and group_size % BLOCK == 0 and in_features % group_size == 0)


def pack(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> packed."""
    n, k = q.shape
    v = q.to(torch.uint8).view(n // LANES, LANES, k // 8, 2, 4).permute(0, 2, 1, 4, 3)
    return (v[..., 0] | (v[..., 1] << 4)).contiguous()


def pack_scales(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor | None:
    """float [N, G] scales and zeros (w = q * scale + zero) -> scale_zero; None if float16
    cannot hold them."""
    n, groups = scale.shape
    both = torch.stack([scale.float(), zero.float()], 1)  # [N, 2, G]
    half = both.view(n // LANES, LANES, 2, groups).permute(0, 3, 2, 1).to(torch.float16)
    return half.contiguous() if torch.isfinite(half).all() else None


def unpack_kn(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values 0..15 as [K, N] in `dtype`, each nibble converted straight into its place."""
    blocks, steps = packed.shape[:2]
    out = torch.empty(steps, 2, 4, blocks, LANES, dtype=dtype, device=packed.device)
    by_column = packed.permute(1, 3, 0, 2)  # [K / 8, 4, B, 16]
    out[:, 0].copy_(by_column & 15)
    out[:, 1].copy_(by_column >> 4)
    return out.view(steps * 8, blocks * LANES)


def rows(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """uint8 [T, K] values 0..15 of output rows `index`."""
    lanes = packed[index // LANES, :, index % LANES]  # [T, K / 8, 4]
    return torch.stack([lanes & 15, lanes >> 4], -2).reshape(len(index), -1)


def scale_rows(scale_zero: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 [T, G] scales and zeros of output rows `index`."""
    picked = scale_zero[index // LANES, :, :, index % LANES]  # [T, G, 2]
    return picked[..., 0], picked[..., 1]


def scale_kn(scale_zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 [G, N] scales and zeros."""
    blocks, groups = scale_zero.shape[:2]
    both = scale_zero.permute(1, 2, 0, 3).reshape(groups, 2, blocks * LANES)
    return both[:, 0], both[:, 1]
