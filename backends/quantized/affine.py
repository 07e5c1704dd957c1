"""The one in-memory form every integer format converts to before it is packed for a kernel.

`AffineInt4`: w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g] over the columns in `perm`
order (g = column // group_size). This is the convention of torch's int4 weight-only kernels
(`_weight_int4pack_mm*`), so GPTQ / AWQ / GGUF zero points become float zeros exactly once.
`AffineInt8` (q in 0..255, integer zero points) is carried into it as two 4-bit halves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KERNEL_GROUPS = (256, 128, 64, 32)


@dataclass
class AffineInt4:
    q: torch.Tensor  # uint8 [N, K], values 0..15, columns in `perm` order
    scale: torch.Tensor  # float32 [N, K // group_size]
    zero: torch.Tensor  # float32 [N, K // group_size]
    group_size: int
    perm: torch.Tensor | None = None  # long [K]: the kernel's column i is input feature perm[i]
    repeats: int = 1  # the input is fed `repeats` times side by side (8-bit as two halves)

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1] // self.repeats

    @classmethod
    def from_int_zeros(
        cls, q: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor, group_size: int,
        perm: torch.Tensor | None = None,
    ) -> AffineInt4:
        """From w = (q - zeros) * scale with integer zero points (GPTQ, AWQ)."""
        scale = scale.float()
        return cls(q, scale, (8.0 - zeros.float()) * scale, group_size, perm)

    def with_group(self, group_size: int) -> AffineInt4:
        """The same weights described with a smaller group (scales repeated)."""
        if group_size == self.group_size:
            return self
        factor = self.group_size // group_size
        return AffineInt4(
            self.q, self.scale.repeat_interleave(factor, 1),
            self.zero.repeat_interleave(factor, 1), group_size, self.perm, self.repeats,
        )

    def kernel_group(self) -> int | None:
        """The largest kernel group size that divides ours, or None if none does."""
        for size in KERNEL_GROUPS:
            if self.group_size % size == 0:
                return size
        return None

    def dense(self) -> torch.Tensor:
        """float32 [N, in_features] in the original column order."""
        n, k = self.q.shape
        w = (self.q.float().view(n, -1, self.group_size) - 8) * self.scale.unsqueeze(-1)
        w = (w + self.zero.unsqueeze(-1)).view(n, k)
        if self.repeats > 1:
            w = w.view(n, self.repeats, -1).sum(1)
        if self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm] = w
            w = out
        return w


def same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


def concat_rows(parts: list[AffineInt4]) -> AffineInt4 | None:
    """One weight with the parts' rows stacked, or None if their layouts differ."""
    first = parts[0]
    group = min(p.group_size for p in parts)
    if any(
        p.group_size % group or p.repeats != first.repeats or not same_perm(p.perm, first.perm)
        or p.q.shape[1] != first.q.shape[1]
        for p in parts
    ):
        return None
    parts = [p.with_group(group) for p in parts]
    return AffineInt4(
        torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
        torch.cat([p.zero for p in parts]), group, first.perm, first.repeats,
    )


def permute_rows(weight: AffineInt4, rows: torch.Tensor) -> AffineInt4:
    return AffineInt4(
        weight.q[rows], weight.scale[rows], weight.zero[rows], weight.group_size, weight.perm,
        weight.repeats,
    )


@dataclass
class AffineInt8:
    q: torch.Tensor  # uint8 [N, K], values 0..255, columns in `perm` order
    scale: torch.Tensor  # float32 [N, K // group_size]
    zeros: torch.Tensor  # float32 [N, K // group_size], integer zero points (128: symmetric)
    group_size: int
    perm: torch.Tensor | None = None

    def as_int4_halves(self) -> AffineInt4:
        """q = 16 hi + lo, so w = 16 s (hi - 8) + (128 - z) s  +  s (lo - 8) + 8 s, exactly."""
        hi, lo = self.q >> 4, self.q & 15
        s = self.scale.float()
        z = self.zeros.float()
        return AffineInt4(
            torch.cat([hi, lo], dim=1),
            torch.cat([16 * s, s], dim=1),
            torch.cat([(128 - z) * s, 8 * s], dim=1),
            self.group_size, self.perm, repeats=2,
        )

    def symmetric_per_channel(self) -> bool:
        return self.scale.shape[1] == 1 and bool((self.zeros == 128).all())

    def dense(self) -> torch.Tensor:
        n, k = self.q.shape
        w = (self.q.float().view(n, -1, self.group_size) - self.zeros.unsqueeze(-1))
        w = (w * self.scale.unsqueeze(-1)).view(n, k)
        if self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm] = w
            w = out
        return w


def groups_to_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The column order that makes `g_idx` contiguous groups of `group_size`.

    None when g_idx is already column // group_size (no reordering needed). Raises ValueError
    when the groups are not all of size `group_size` (no exact kernel layout exists).
    """
    k = g_idx.numel()
    g_idx = g_idx.long()
    if torch.equal(g_idx, torch.arange(k) // group_size):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], torch.arange(k) // group_size):
        raise ValueError(f"g_idx does not split the {k} input features into groups of {group_size}")
    return perm
