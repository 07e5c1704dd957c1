"""Paged attention over a preallocated KV cache (torch path, CPU and CUDA).

A step's tokens are flattened: first one query token per decoding sequence, then
the prompt chunks of prefilling sequences. Metadata is built once per step and
shared by every layer.

Each layer attends with its own window (`window`: the last `window` positions, 0: all of them).
A model has one window at most (its sliding layers'), so the metadata carries at most two
masks: `mask` for the layers' common rule (full attention, or where every layer slides, the
window) and, where a model mixes sliding and full layers (Gemma 3, Qwen2's
`max_window_layers`), `window_mask` for the sliding ones. Every layer keeps every KV block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F

from backends.cpu_kernels.build import active_variant

KERNEL_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # built into our attention kernels
# Prompt chunks attending more positions go to torch's SDPA: ours ran 2x faster at 128-512,
# even at 2048 (bench/attention_kernels.py)
KERNEL_PREFILL_MAX_CONTEXT = 2048


@dataclass
class PrefillChunk:
    """One sequence's prompt chunk: rows [start, start+length) of the step."""

    start: int
    length: int
    context_len: int  # cached + new tokens this chunk attends to
    block_table: torch.Tensor | None  # None when the chunk is the whole context (no cache read)
    mask: torch.Tensor | None  # additive [length, context_len] mask; None: plain causal
    # Set instead of the two above where our C++ kernel attends (it reads the cache, causal,
    # and takes each layer's window itself)
    kernel_blocks: torch.Tensor | None = None  # the sequence's blocks covering the context
    # The sliding layers' mask where their window cuts into the context (else `mask` serves)
    window_mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] cache block of each new token
    slot_offsets: torch.Tensor  # [T] its offset inside that block
    num_decode: int  # decode rows come first
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] (padded with block 0)
    decode_mask: torch.Tensor | None  # [B, max_blocks*block_size] additive, float32
    # [start, end) of the positions each row attends in full; a sliding layer keeps the last
    # `window` of them
    decode_spans: list[tuple[int, int]] | None
    prefills: list[PrefillChunk]
    compiled: bool = False  # decode through the torch.compile'd fused kernel
    decode_window_mask: torch.Tensor | None = None  # the sliding layers' (mixed models)


@dataclass
class DecodeMetadata:
    """A step where every row decodes, run as one compiled graph (`compiled_step.py`): tensors
    only, so that the graph's guards see shapes, never Python values that change per step."""

    slot_blocks: torch.Tensor  # [B]
    slot_offsets: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max_blocks >= 2] (padded with block 0; masked)
    mask: torch.Tensor  # [B, max_blocks*block_size] additive, float32
    window_mask: torch.Tensor | None = None  # the sliding layers' (mixed models)


class KVCache:
    """Per-layer K and V tensors shaped [num_blocks, kv_heads, block_size, head_dim].

    Head-major blocks keep each head's [block_size, head_dim] tile contiguous, which the
    fused decode kernel reads at about twice the speed of the token-major layout."""

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        shape = (num_blocks, kv_heads, block_size, head_dim)
        self.block_size = block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block src to block dst in every layer's K and V (copy on write of forks)."""
        if not pairs:
            return
        device = self.k[0].device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
        for cache in (*self.k, *self.v):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, meta: AttentionMetadata | DecodeMetadata, scale: float,
    cpu_kernel: bool = False, cache_written: bool = False, window: int = 0,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (new tokens) -> [T, H, D]. Writes k/v into the cache.
    `cpu_kernel`: decode rows that would run compiled go through our C++ kernel instead
    (`attention_kernels_fit` said it is built and covers these shapes); prompt chunks do where
    the model runner gave them `kernel_blocks`. `cache_written`: the caller wrote k/v.
    `window`: the calling layer's sliding window (0: it attends every position)."""
    if not cache_written:
        k_cache[meta.slot_blocks, :, meta.slot_offsets] = k
        v_cache[meta.slot_blocks, :, meta.slot_offsets] = v
    if isinstance(meta, DecodeMetadata):  # traced into the whole-step graph: no nested compile
        mask = layer_mask(meta.mask, meta.window_mask, window)
        if cpu_kernel:
            return torch.ops.switchyard_cpu.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, mask, scale)
        return _decode_fused(q, k_cache, v_cache, meta.block_tables, mask, scale)
    parts = []
    if meta.num_decode:
        parts.append(_decode_attention(
            q[: meta.num_decode], k_cache, v_cache, meta, scale, cpu_kernel, window))
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        if chunk.kernel_blocks is not None:
            parts.append(torch.ops.switchyard_cpu.paged_prefill_attention(
                q[rows], k_cache, v_cache, chunk.kernel_blocks, chunk.context_len, window,
                scale))
        else:
            mask = layer_mask(chunk.mask, chunk.window_mask, window)
            parts.append(_prefill_attention(
                q[rows], k[rows], v[rows], k_cache, v_cache, chunk, mask, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def layer_mask(mask: torch.Tensor | None, window_mask: torch.Tensor | None,
               window: int) -> torch.Tensor | None:
    """The mask a layer with `window` attends by: the sliding layers' own where there is one."""
    return window_mask if window and window_mask is not None else mask


def windowed_spans(spans: list[tuple[int, int]], window: int) -> list[tuple[int, int]]:
    """The last `window` positions of each [start, end) span (all of them for window 0)."""
    if not window:
        return spans
    return [(max(start, end - window), end) for start, end in spans]


def decode_mask(starts: torch.Tensor, ends: torch.Tensor, length: int) -> torch.Tensor:
    """Additive float32 [B, length] mask: 0 at the positions [start, end) of each row."""
    position = torch.arange(length, device=starts.device).unsqueeze(0)
    allowed = (position >= starts.unsqueeze(1)) & (position < ends.unsqueeze(1))
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=starts.device)
    return mask.masked_fill(~allowed, float("-inf"))


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, KVH, bs, D] by [B, nb] -> [B, KVH, nb*bs, D] (a copy)."""
    b, nb = block_tables.shape
    _, kvh, bs, d = cache.shape
    blocks = cache.index_select(0, block_tables.reshape(-1)).view(b, nb, kvh, bs, d)
    return blocks.transpose(1, 2).reshape(b, kvh, nb * bs, d)


def attention_kernels_fit(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
    block_size: int,
) -> bool:
    """Whether our attention kernels (cpu_kernels/paged_attention.cpp for decode rows,
    prefill_attention.cpp for prompt chunks) are built in this process and cover these shapes."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and head_dim in KERNEL_HEAD_DIMS and heads % kv_heads == 0
            and heads // kv_heads <= 16 and block_size <= 64 and active_variant() is not None)


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, cpu_kernel: bool, window: int,
) -> torch.Tensor:
    tables = meta.decode_block_tables
    mask = layer_mask(meta.decode_mask, meta.decode_window_mask, window)
    if not meta.compiled:
        spans = windowed_spans(meta.decode_spans, window)
        return _decode_eager(q, k_cache, v_cache, tables, spans, scale)
    if cpu_kernel:
        return torch.ops.switchyard_cpu.paged_decode_attention(
            q, k_cache, v_cache, tables, mask, scale)
    if q.shape[0] == 1:  # pad to two rows: one compiled graph serves every batch size
        q = torch.cat((q, q))
        tables = torch.cat((tables, tables))
        mask = torch.cat((mask, mask))
        with no_duck_shapes():
            return _compiled_decode()(q, k_cache, v_cache, tables, mask, scale)[:1]
    with no_duck_shapes():
        return _compiled_decode()(q, k_cache, v_cache, tables, mask, scale)


def _decode_eager(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    tables: torch.Tensor, spans: list[tuple[int, int]], scale: float,
) -> torch.Tensor:
    """SDPA per sequence over exactly the positions it attends: no padding or mask, so the
    kernel sums in the same order as transformers' decode step and the logits agree bit
    for bit (a masked, padded tail changes SDPA's rounding by a bf16 step or so)."""
    block_size = k_cache.shape[2]
    out = torch.empty_like(q)
    for i, (start, end) in enumerate(spans):
        first, last = start // block_size, -(-end // block_size)
        table = tables[i: i + 1, first:last]
        span = slice(start - first * block_size, end - first * block_size)
        keys = _gather(k_cache, table)[0, :, span]  # [KVH, L, D]
        values = _gather(v_cache, table)[0, :, span]
        out[i] = F.scaled_dot_product_attention(  # 4-D: SDPA's CPU flash kernel
            q[i].view(1, -1, 1, q.shape[-1]), keys.unsqueeze(0), values.unsqueeze(0),
            scale=scale, enable_gqa=True,
        ).view(-1, q.shape[-1])
    return out


def _decode_fused(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    tables: torch.Tensor, mask: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Gather, scores, softmax and weighted sum written as reductions over (block,
    offset), so that the compiler fuses them into passes over the cache tiles instead
    of materialising gathered copies of K and V."""
    b, h, d = q.shape
    nb = tables.shape[1]
    _, kvh, bs, _ = k_cache.shape
    keys = k_cache[tables].float().unsqueeze(3)  # [B, nb, KVH, 1, bs, D]
    values = v_cache[tables].float().unsqueeze(3)
    qg = q.view(b, 1, kvh, h // kvh, 1, d).float()
    scores = (qg * keys).sum(-1) * scale + mask.view(b, nb, 1, 1, bs)  # [B, nb, KVH, G, bs]
    weights = torch.exp(scores - scores.amax(dim=(1, 4), keepdim=True))
    total = weights.sum(dim=(1, 4))  # [B, KVH, G]
    out = (weights.unsqueeze(-1) * values).sum(dim=(1, 4)) / total.unsqueeze(-1)
    return out.reshape(b, h, d).to(q.dtype)


@contextmanager
def no_duck_shapes() -> Iterator[None]:
    """No duck shapes while tracing: sizes that happen to be equal in the traced call (a
    batch of two rows and a table two blocks wide, as in the warm-up) must not be tied, or
    the first step where they differ compiles again (0.5 s inside a client's request). A
    plain attribute set: `config.patch` costs ~50 us a call."""
    saved = fx_config.use_duck_shape
    fx_config.use_duck_shape = False
    try:
        yield
    finally:
        fx_config.use_duck_shape = saved


@functools.cache
def _compiled_decode() -> Callable[..., torch.Tensor]:
    return torch.compile(_decode_fused, dynamic=True)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, chunk: PrefillChunk, mask: torch.Tensor | None, scale: float,
) -> torch.Tensor:
    """`mask`: the chunk's, for this layer's window (None: plain causal over the new rows)."""
    if chunk.block_table is None:
        keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, n, D]
    else:
        keys = _gather(k_cache, chunk.block_table.unsqueeze(0))[0, :, : chunk.context_len]
        values = _gather(v_cache, chunk.block_table.unsqueeze(0))[0, :, : chunk.context_len]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=None if mask is None else mask.to(q.dtype),
        is_causal=mask is None, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)
