"""An MoE block in one C++ call (cpu_kernels/moe_block.cpp) against the Python block over the
same bf16 kernel operators: equal bit for bit at 1, 3 and 40 rows, with and without the top-k
normalisation and with the weights in bf16 and float32; the block takes the C++ path only
where every expert's linears run our bf16 kernel, holding each weight once; bad input is
refused."""

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

HIDDEN, EXPERTS, TOP_K, EXPERT_SIZE = 64, 8, 4, 32


def _block(seed: int = 0, renormalize: bool = True,
           float32_weights: bool = False) -> SparseMoeBlock:
    """A random bf16 block (weights scaled so the outputs are far from zero and from
    saturating silu)."""
    torch.manual_seed(seed)
    block = SparseMoeBlock(HIDDEN, EXPERTS, TOP_K, EXPERT_SIZE, renormalize=renormalize,
                           float32_weights=float32_weights)
    with torch.no_grad():
        for parameter in block.parameters():
            nn.init.normal_(parameter, std=HIDDEN ** -0.5)
    return block.to(torch.bfloat16).eval()


@pytest.fixture(scope="module", params=[(True, False), (False, False), (True, True)],
                ids=["renormalized", "plain", "float32-weights"])
def prepacked(request: pytest.FixtureRequest) -> SparseMoeBlock:
    renormalize, float32_weights = request.param
    block = _block(renormalize=renormalize, float32_weights=float32_weights)
    prepack_linears(block, bf16_kernel=True)
    return block


def _loop_output(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The block's output on the Python path over the experts' operators."""
    assert block.uses_fused_experts()
    fused = block.fused
    block.fused = None
    try:
        return block.route_and_run(x)
    finally:
        block.fused = fused


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_cpp_block_equals_the_python_block(prepacked: SparseMoeBlock, rows: int) -> None:
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).bfloat16()
    before = prepacked.expert_tokens.clone()
    with torch.no_grad():
        fused = prepacked.route_and_run(x)
        after_fused = prepacked.expert_tokens.clone()
        loop = _loop_output(prepacked, x)
    assert fused.abs().max() > 0.01
    assert torch.equal(fused, loop)
    # Both calls counted the same routed tokens, top-k a row.
    assert torch.equal(after_fused - before, prepacked.expert_tokens - after_fused)
    assert int((after_fused - before).sum()) == rows * TOP_K


def test_no_rows_give_no_rows(prepacked: SparseMoeBlock) -> None:
    with torch.no_grad():
        assert prepacked.route_and_run(torch.empty(0, HIDDEN).bfloat16()).shape == (0, HIDDEN)


def test_each_expert_weight_is_held_once(prepacked: SparseMoeBlock) -> None:
    """The linears keep views of the stacked weights the C++ block reads."""
    assert prepacked.uses_fused_experts() and prepacked.fused is not None
    stacked = prepacked.fused.gate_up.untyped_storage().data_ptr()
    for expert in prepacked.experts:
        assert expert.gate_up_proj.packed.untyped_storage().data_ptr() == stacked
    assert prepacked.experts[5].down_proj.packed.data_ptr() == prepacked.fused.down[5].data_ptr()


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


def test_bad_input_is_refused() -> None:
    block = _block()
    prepack_linears(block, bf16_kernel=True)
    assert block.uses_fused_experts() and block.fused is not None
    x = torch.randn(3, HIDDEN).bfloat16()
    logits = block.gate(x)
    gate_up, down, counted = block.fused.gate_up, block.fused.down, block.expert_tokens
    run = torch.ops.switchyard_cpu.bf16_moe_block
    with pytest.raises(RuntimeError, match="logits must be"):
        run(x, logits[:2], gate_up, down, TOP_K, True, False, counted)
    with pytest.raises(RuntimeError, match="top_k must be in 1..8"):
        run(x, logits, gate_up, down, 9, True, False, counted)
    with pytest.raises(RuntimeError, match="the 8 experts' packed weights"):
        run(x, logits, gate_up[:4], down, TOP_K, True, False, counted)
    with pytest.raises(RuntimeError, match="expert_tokens must be int64"):
        run(x, logits, gate_up, down, TOP_K, True, False, counted.int())
    with pytest.raises(RuntimeError, match="x must be contiguous bfloat16"):
        run(x.float(), logits, gate_up, down, TOP_K, True, False, counted)
