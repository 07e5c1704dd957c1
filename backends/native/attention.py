"""Paged attention over a preallocated KV cache (torch path, CPU and CUDA).

A step's tokens are flattened: first one query token per decoding sequence, then
the prompt chunks of prefilling sequences. Metadata is built once per step and
shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's prompt chunk: rows [start, start+length) of the step."""

    start: int
    length: int
    context_len: int  # cached + new tokens this chunk attends to
    block_table: torch.Tensor | None  # None when the chunk is the whole context (no cache read)
    mask: torch.Tensor | None  # additive [length, context_len] mask; None: plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot for each new token
    num_decode: int  # decode rows come first
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] (padded with block 0)
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks*block_size] additive
    prefills: list[PrefillChunk]


class KVCache:
    """Per-layer K and V tensors shaped [num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.block_size = block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (new tokens) -> [T, H, D]. Writes k/v into the cache."""
    _write_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.num_decode:
        out[: meta.num_decode] = _decode_attention(
            q[: meta.num_decode], k_cache, v_cache, meta, scale
        )
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
    return out


def _write_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    kvh, d = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, KVH, D] by [B, nb] -> [B, KVH, nb*bs, D]."""
    b, nb = block_tables.shape
    _, bs, kvh, d = cache.shape
    blocks = cache.index_select(0, block_tables.reshape(-1)).view(b, nb * bs, kvh, d)
    return blocks.transpose(1, 2)


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    # Fold each KV group's query heads into rows: two batched matmuls beat SDPA with
    # enable_gqa for one query token (see shared/PERFORMANCE.md).
    b, h, d = q.shape
    keys = _gather(k_cache, meta.decode_block_tables)  # [B, KVH, L, D]
    values = _gather(v_cache, meta.decode_block_tables)
    kvh = keys.shape[1]
    qg = q.view(b, kvh, h // kvh, d)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale + meta.decode_mask
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(b, h, d)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
) -> torch.Tensor:
    if chunk.block_table is None:
        keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, n, D]
    else:
        keys = _gather(k_cache, chunk.block_table.unsqueeze(0))[0, :, : chunk.context_len]
        values = _gather(v_cache, chunk.block_table.unsqueeze(0))[0, :, : chunk.context_len]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=None if chunk.mask is None else chunk.mask.to(q.dtype),
        is_causal=chunk.mask is None, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)
