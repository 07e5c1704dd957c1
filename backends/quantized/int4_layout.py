"""Where torch's CPU int4 packing (`_convert_weight_to_int4pack_for_cpu`) puts each weight.

The packing depends on the instruction set torch dispatches to (read once per process): seen
so far, rows in blocks of 64 with byte j = rows (j, j + 32) on AVX-512, blocks of 32 with rows
(j, j + 16) on AVX2, and blocks of 32 with rows (2j, 2j + 1) without vector kernels. Rather than
knowing each, we pack a probe of known values once and read the layout off where each value
landed: per block of `block` output rows, for each input column, `block // 2` bytes whose low
and high nibbles hold the rows `rows_at` names. Unpacking (dequantize + matmul for prefill) and
row reads (a tied embedding kept packed) use that map; a packing that is not of this form is
reported as unknown and its users fall back to a dense copy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

_PROBE_ROWS, _PROBE_COLS = 256, 64  # 16384 positions: four nibble-digit probes name each one
_CHECK_ROWS_BLOCKS, _CHECK_COLS = 3, 96  # a second shape the derived layout must also unpack


@dataclass(frozen=True)
class Int4PackLayout:
    block: int  # output rows per block
    # nibble slot (low nibbles of the block's bytes, then high) holding each row of a block
    slot_of_row: torch.Tensor  # long [block]

    @property
    def identity(self) -> bool:
        return torch.equal(self.slot_of_row, torch.arange(self.block))

    def supports(self, out_features: int) -> bool:
        return out_features % self.block == 0

    def unpack(self, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """uint8 [K, N] values 0..15 from a packed [N, K / 2] tensor."""
        half = self.block // 2
        b = packed.view(n // self.block, k, half)
        slots = torch.cat([b & 15, b >> 4], -1)  # [blocks, K, block] in slot order
        if not self.identity:
            slots = slots.index_select(-1, self.slot_of_row.to(packed.device))
        return slots.permute(1, 0, 2).reshape(k, n)

    def unpack_to(self, packed: torch.Tensor, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        """`unpack` converted to `dtype`; for a layout in row order each nibble is written
        straight to its place (one strided copy per half: 3x faster than unpacking first)."""
        if not self.identity:
            return self.unpack(packed, n, k).to(dtype)
        half = self.block // 2
        nibbles = packed.view(n // self.block, k, half).transpose(0, 1)  # [K, blocks, half]
        out = torch.empty(k, n // self.block, 2, half, dtype=dtype, device=packed.device)
        out[:, :, 0].copy_(nibbles & 15)  # a block's first half of rows: the low nibbles
        out[:, :, 1].copy_(nibbles >> 4)
        return out.view(k, n)

    def rows(self, packed: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
        """uint8 [T, K] values 0..15 of output rows `index`, read from the packed tensor."""
        half = self.block // 2
        blocks = packed.view(-1, k, half)
        slot = self.slot_of_row.to(index.device)[index % self.block]
        picked = blocks[index // self.block, :, slot % half]  # [T, K] bytes
        return (picked >> (4 * (slot // half)).unsqueeze(1).to(picked.dtype)) & 15


def _pack(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)


def source_positions(rows: int, cols: int) -> torch.Tensor:
    """For each packed nibble in memory order (byte by byte, low then high), the flat index
    row * cols + col of the weight stored there."""
    index = torch.arange(rows * cols).view(rows, cols)
    found = torch.zeros(rows * cols, dtype=torch.long)
    for digit in range((rows * cols - 1).bit_length() // 4 + 1):
        packed = _pack((index >> (4 * digit)) & 15)
        nibbles = torch.stack([packed & 15, packed >> 4], -1).reshape(-1).long()
        found |= nibbles << (4 * digit)
    return found


def derive_layout(source: torch.Tensor, rows: int, cols: int) -> Int4PackLayout | None:
    row, col = source // cols, source % cols
    moved = (col != 0).nonzero()
    block = int(moved[0]) if len(moved) else 0  # nibbles of column 0 before column 1 starts
    if block < 2 or block % 2 or rows % block:
        return None
    half = block // 2
    byte, high = torch.arange(source.numel()) // 2, torch.arange(source.numel()) % 2
    blk, within = byte // (cols * half), byte % half
    slot = high * half + within
    rows_at = row[:block].view(half, 2).t().reshape(-1)  # slot -> row, read off block 0
    if not torch.equal(rows_at.sort().values, torch.arange(block)):
        return None
    layout = Int4PackLayout(block, torch.argsort(rows_at))
    expected_col = (byte // half) % cols
    if not (torch.equal(row, blk * block + rows_at[slot]) and torch.equal(col, expected_col)):
        return None
    return layout


def _round_trips(layout: Int4PackLayout) -> bool:
    n, k = _CHECK_ROWS_BLOCKS * layout.block, _CHECK_COLS
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(0))
    packed = _pack(q)
    index = torch.tensor([0, n - 1, layout.block + 1, n // 2])
    return (torch.equal(layout.unpack(packed, n, k).long(), q.t())
            and torch.equal(layout.rows(packed, index, k).long(), q[index]))


@functools.cache
def cpu_int4_layout() -> Int4PackLayout | None:
    """This process's int4 packing layout, or None if it is not a row-block layout."""
    layout = derive_layout(source_positions(_PROBE_ROWS, _PROBE_COLS), _PROBE_ROWS, _PROBE_COLS)
    return layout if layout is not None and _round_trips(layout) else None
