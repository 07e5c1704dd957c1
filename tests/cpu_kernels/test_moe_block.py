"""An MoE block's experts in one C++ call (cpu_kernels/moe_experts.cpp) against the Python loop
over the same bf16 kernel operators: equal bit for bit at 1, 3 and 40 rows; the block takes
the C++ path only where every expert's linears run our bf16 kernel; bad input is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backends.cpu_kernels.build import bf16_linear_built
from backends.native.layers.cpu_linear import prepack_linears
from backends.native.models.moe import SparseMoeBlock

pytestmark = pytest.mark.skipif(
    not bf16_linear_built(), reason="this CPU has no AVX-512-BF16 (or our kernels are off): "
    "MoE experts stay on the Python loop, which tests/native/models/test_moe.py covers")

HIDDEN, EXPERTS, TOP_K, EXPERT_SIZE = 64, 8, 2, 32


def _block(seed: int = 0) -> SparseMoeBlock:
    """A random bf16 block (weights scaled so the outputs are far from zero and from
    saturating silu)."""
    torch.manual_seed(seed)
    block = SparseMoeBlock(HIDDEN, EXPERTS, TOP_K, EXPERT_SIZE, renormalize=True)
    with torch.no_grad():
        for parameter in block.parameters():
            nn.init.normal_(parameter, std=HIDDEN ** -0.5)
    return block.to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def prepacked() -> SparseMoeBlock:
    block = _block()
    prepack_linears(block, bf16_kernel=True)
    return block


def _loop_output(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The block's output with the Python loop over the experts' operators."""
    assert block.uses_fused_experts()
    fused = block.fused
    block.fused = None
    try:
        return block.route_and_run(x)
    finally:
        block.fused = fused


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_fused_experts_equal_the_loop(prepacked: SparseMoeBlock, rows: int) -> None:
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).bfloat16()
    before = prepacked.expert_tokens.clone()
    with torch.no_grad():
        fused = prepacked.route_and_run(x)
        loop = _loop_output(prepacked, x)
    assert fused.abs().max() > 0.01
    assert torch.equal(fused, loop)
    # Both calls counted their routed tokens, top-k a row.
    assert int((prepacked.expert_tokens - before).sum()) == 2 * rows * TOP_K


def test_block_picks_the_cpp_path_only_on_the_bf16_kernel() -> None:
    plain = _block()
    assert not plain.uses_fused_experts()
    onednn = _block()
    prepack_linears(onednn, bf16_kernel=False)
    assert not onednn.uses_fused_experts()
    kernel = _block()
    prepack_linears(kernel, bf16_kernel=True)
    assert kernel.uses_fused_experts()
    # One expert left on torch's linear: the whole block keeps the loop.
    mixed = _block()
    prepack_linears(mixed, bf16_kernel=True)
    mixed.experts[3].down_proj = nn.Linear(EXPERT_SIZE, HIDDEN, bias=False).bfloat16()
    assert not mixed.uses_fused_experts()


def test_bad_input_is_refused(prepacked: SparseMoeBlock) -> None:
    assert prepacked.uses_fused_experts() and prepacked.fused is not None
    grouped = torch.randn(3, HIDDEN).bfloat16()
    gate_up, down = list(prepacked.fused.gate_up[:2]), list(prepacked.fused.down[:2])
    with pytest.raises(RuntimeError, match="counts sum to 4"):
        torch.ops.switchyard_cpu.bf16_moe_experts(grouped, [1, 3], gate_up, down)
    with pytest.raises(RuntimeError, match="counts must be positive"):
        torch.ops.switchyard_cpu.bf16_moe_experts(grouped, [3, 0], gate_up, down)
    with pytest.raises(RuntimeError, match="1 gate_up"):
        torch.ops.switchyard_cpu.bf16_moe_experts(grouped, [1, 2], gate_up[:1], down)
