"""Our C++ attention kernels: decode rows (backends/cpu_kernels/paged_attention.cpp) and
prompt chunks (prefill_attention.cpp), against a float64 softmax over exactly the positions
each row attends, for every head size built in, query groups, block sizes, sliding windows,
cached prefixes and padded tables; their AVX2 code where torch dispatches to AVX2; where the
engine uses them, and the same tokens with them as without (chunked, prefix-cached too)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from backends.base import SamplingParams
from backends.cpu_kernels.build import active_variant
from backends.native.layers.attention import KERNEL_HEAD_DIMS, attention_kernels_fit, decode_mask
from tests.native.test_parity import make_engine
from tests.quantized.helpers import has_avx2, run_in_child

CPU = torch.device("cpu")


def _case(batch: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
          spans: list[tuple[int, int]], width: int, dtype: torch.dtype, seed: int):
    """Random caches and queries; row i attends positions spans[i] of a table `width` blocks
    wide (blocks scattered through the cache, the tail padded with block 0)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = batch * width + 3
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width)
    for i, (_, end) in enumerate(spans):
        tables[i, -(-end // block_size):] = 0
    starts = torch.tensor([s for s, _ in spans])
    ends = torch.tensor([e for _, e in spans])
    return q, k_cache, v_cache, tables, decode_mask(starts, ends, width * block_size)


def _reference(q, k_cache, v_cache, tables, spans, scale) -> torch.Tensor:
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    out = torch.empty(batch, heads, head_dim, dtype=torch.float64)
    for i, (start, end) in enumerate(spans):
        keys = k_cache[tables[i]].double().transpose(0, 1).reshape(kv_heads, -1, head_dim)
        values = v_cache[tables[i]].double().transpose(0, 1).reshape(kv_heads, -1, head_dim)
        keys, values = keys[:, start:end], values[:, start:end]
        group = heads // kv_heads
        query = q[i].double().view(kv_heads, group, head_dim)
        weights = torch.softmax(query @ keys.transpose(1, 2) * scale, dim=-1)
        out[i] = (weights @ values).reshape(heads, head_dim)
    return out


def check_against_float64() -> str:
    variant = active_variant()
    cases = [  # batch, heads, kv heads, block size, spans, table width
        (3, 4, 4, 16, [(0, 5), (0, 64), (0, 33)], 4),
        (2, 9, 3, 16, [(3, 40), (0, 17)], 3),  # GQA, a window starting inside a block
        (1, 8, 2, 32, [(20, 50)], 2),  # one row: kv heads split between threads
        (4, 12, 1, 4, [(0, 1), (0, 9), (5, 13), (0, 16)], 5),  # blocks smaller than a vector
        (2, 16, 2, 16, [(40, 41), (0, 70)], 6),  # a window of one position, whole blocks out
        (1, 9, 3, 16, [(40, 70)], 5),  # on 2+ threads split over blocks: one part attends nothing
    ]
    for head_dim in KERNEL_HEAD_DIMS:
        for seed, (batch, heads, kv_heads, block_size, spans, width) in enumerate(cases):
            for dtype, tolerance in ((torch.float32, 2e-6), (torch.bfloat16, 2**-8)):
                q, k_cache, v_cache, tables, mask = _case(
                    batch, heads, kv_heads, head_dim, block_size, spans, width, dtype, seed)
                scale = 1 / math.sqrt(head_dim)
                got = torch.ops.switchyard_cpu.paged_decode_attention(
                    q, k_cache, v_cache, tables, mask, scale)
                want = _reference(q, k_cache, v_cache, tables, spans, scale)
                assert got.dtype == dtype and got.shape == q.shape
                diff = (got.double() - want).abs() - tolerance * want.abs()
                assert diff.max().item() <= 2e-6, (head_dim, seed, dtype, diff.max().item())
    return str(variant)


def _prefill_reference(q, k_cache, v_cache, table, context, window, scale) -> torch.Tensor:
    rows, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    keys = k_cache[table].double().transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :context]
    values = v_cache[table].double().transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :context]
    group = heads // kv_heads
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    q_pos = torch.arange(context - rows, context).unsqueeze(1)
    k_pos = torch.arange(context).unsqueeze(0)
    allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    scores = torch.einsum("nhd,hkd->hnk", q.double(), keys) * scale
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hnk,hkd->nhd", weights, values)


def check_prefill_against_float64() -> None:
    active_variant()  # loads the kernels (in a child process, this runs first)
    cases = [  # rows, context, heads, kv heads, block size, window
        (128, 128, 4, 4, 16, 0),  # a whole prompt: two tiles of rows
        (150, 190, 4, 2, 16, 0),  # a long chunk after 40 cached positions: tiles and key
        # runs out of step, rows before a run skipped, a run's last keys past its end
        (19, 19, 9, 3, 16, 0),  # GQA, a prompt shorter than a tile
        (5, 40, 4, 2, 4, 0),  # a chunk after 35 cached positions, blocks of 4
        (37, 100, 8, 2, 16, 12),  # a sliding window inside a cached context
        (70, 70, 4, 4, 32, 30),  # a window on a whole prompt
        (1, 1, 4, 2, 16, 0),  # one token
    ]
    for head_dim in KERNEL_HEAD_DIMS:
        for seed, (rows, context, heads, kv_heads, block_size, window) in enumerate(cases):
            gen = torch.Generator().manual_seed(seed)
            width = -(-context // block_size)
            shape = (width + 5, kv_heads, block_size, head_dim)
            table = torch.randperm(width + 5, generator=gen)[:width]
            for dtype, tolerance in ((torch.float32, 2e-6), (torch.bfloat16, 2**-8)):
                k_cache = torch.randn(shape, generator=gen).to(dtype)
                v_cache = torch.randn(shape, generator=gen).to(dtype)
                q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
                scale = 1 / math.sqrt(head_dim)
                got = torch.ops.switchyard_cpu.paged_prefill_attention(
                    q, k_cache, v_cache, table, context, window, scale)
                want = _prefill_reference(q, k_cache, v_cache, table, context, window, scale)
                assert got.dtype == dtype and got.shape == q.shape
                diff = (got.double() - want).abs() - tolerance * want.abs()
                assert diff.max().item() <= 2e-6, (head_dim, seed, dtype, diff.max().item())


def test_decode_matches_float64() -> None:
    if active_variant() is None:
        pytest.skip("no C++ kernels for this CPU")
    check_against_float64()


def test_decode_split_over_blocks_matches_float64() -> None:
    """On two threads, batch 1 of few kv heads splits each head's blocks into parts that are
    merged after (the cases above run single-threaded in the suite)."""
    if active_variant() is None:
        pytest.skip("no C++ kernels for this CPU")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_against_float64()
    finally:
        torch.set_num_threads(threads)


def test_prefill_matches_float64() -> None:
    if active_variant() is None:
        pytest.skip("no C++ kernels for this CPU")
    check_prefill_against_float64()


def test_avx2_code_where_torch_dispatches_to_avx2() -> None:
    if not has_avx2():
        pytest.skip("this CPU has no AVX2")
    out = run_in_child("tests.cpu_kernels.test_attention_kernels", "avx2")
    assert out.split() == ["avx2"]


def test_a_malformed_call_raises_a_clear_error() -> None:
    if active_variant() is None:
        pytest.skip("no C++ kernels for this CPU")
    q, k_cache, v_cache, tables, mask = _case(2, 4, 2, 64, 16, [(0, 5), (0, 9)], 2,
                                              torch.float32, 0)
    attend = torch.ops.switchyard_cpu.paged_decode_attention
    with pytest.raises(RuntimeError, match="head size 48 not built in"):
        attend(torch.randn(2, 4, 48), k_cache[..., :48].contiguous(),
               v_cache[..., :48].contiguous(), tables, mask, 0.1)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        attend(q.half(), k_cache.half(), v_cache.half(), tables, mask, 0.1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        attend(q.bfloat16(), k_cache, v_cache, tables, mask, 0.1)
    with pytest.raises(RuntimeError, match=r"mask \[B, nb \* bs\]"):
        attend(q, k_cache, v_cache, tables, mask[:, :16], 0.1)
    prefill = torch.ops.switchyard_cpu.paged_prefill_attention
    with pytest.raises(RuntimeError, match="must cover the context"):
        prefill(q, k_cache, v_cache, tables[0], 40, 0, 0.1)  # 2 blocks of 16 < 40
    with pytest.raises(RuntimeError, match="head size 48 not built in"):
        prefill(torch.randn(2, 4, 48), k_cache[..., :48].contiguous(),
                v_cache[..., :48].contiguous(), tables[0], 9, 0, 0.1)


@pytest.mark.parametrize(("device", "dtype", "head_dim", "kv_heads", "fits"), [
    (CPU, torch.bfloat16, 64, 3, True),
    (CPU, torch.float32, 128, 8, True),
    (CPU, torch.float16, 64, 3, False),  # fp16 never runs on CPU
    (CPU, torch.float32, 48, 3, False),  # a head size not built in
    (CPU, torch.float32, 64, 1, False),  # 24 query heads to one kv head: over the group limit
    (torch.device("meta"), torch.float32, 64, 3, False),
])
def test_where_the_kernel_fits(device, dtype, head_dim, kv_heads, fits) -> None:
    if active_variant() is None:
        pytest.skip("no C++ kernels for this CPU")
    heads = 24 if kv_heads == 1 else 3 * kv_heads
    assert attention_kernels_fit(device, dtype, heads, kv_heads, head_dim, 16) == fits


def test_the_engine_decodes_through_it_with_the_same_tokens(
    tiny_model: Callable[[str], Path],
) -> None:
    """float32, a sliding-window model (masks that start past 0) and GQA, prompts in chunks of
    8 and a prompt repeated (cached prefix): the kernels' greedy tokens equal those of
    inductor's code and torch's SDPA for the same attention, and of the eager engine."""
    if active_variant() is None:
        pytest.skip("no C++ kernels for this CPU")
    prompts = [[1, 5, 9, 12, 7, 3, 22, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50][: 3 + 3 * i]
               for i in range(6)]
    prompts.append(prompts[-1])
    for arch in ("llama_gqa", "mistral_window"):
        path = tiny_model(arch)
        options = {"block_size": 4, "max_batch_total_tokens": 1024,
                   "max_batch_prefill_tokens": 8}
        runs = []
        for settings in ({}, {"attention_kernels": False}, {"compile": False}):
            engine = make_engine(path, **options, **settings)
            uses = [layer.self_attn.cpu_kernel for layer in engine.runner.model.model.layers]
            assert all(uses) == (settings == {}) and any(uses) == all(uses)
            seqs = engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0,
                                                           ignore_eos=True))
            runs.append([s.output_token_ids for s in seqs])
        assert runs[0] == runs[1] == runs[2], arch


if __name__ == "__main__":
    check_prefill_against_float64()
    print(check_against_float64())
