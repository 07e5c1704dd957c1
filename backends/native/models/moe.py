"""The sparse mixture-of-experts block of Qwen3-MoE, Mixtral and OLMoE.

A router (`gate`, hidden -> num_experts, no bias) scores every expert; softmax in float32,
the top-k experts of each token are kept and their weights renormalised where the
architecture does (Mixtral always, Qwen3-MoE / OLMoE with `norm_topk_prob`). Each expert is a
small SwiGLU MLP with Llama's module names (`gate_up_proj` fused, `down_proj`), so that the
prepacked kernels (layers/cpu_linear.py) and the quantized loaders apply to each expert as to
a dense MLP. The tokens are grouped by expert: an expert runs once on exactly the tokens that
chose it, and experts no token chose are never touched.

The grouping is data dependent (how many tokens each expert gets), so it cannot be traced
into the compiled steps' static graphs. The block is called there as one opaque operator
(`switchyard::moe_block`), found by a handle tensor as prepacked weights are: one compiled
layer graph still serves every layer, and the block itself runs eagerly inside it.

Where every expert's linears run our bf16 kernel, everything after the router's matmul runs in
one C++ call (`switchyard_cpu::bf16_moe_block`, cpu_kernels/moe_block.cpp) with this module's
results bit for bit: at one token the Python block's ~20 dispatcher calls, module calls,
slices and cat cost as much as the kernels.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from backends.native.layers.cpu_linear import PrepackedLinear
from backends.native.models.llama import FusedLinear, LlamaMLP
from backends.quantized.resident import resident_bytes

_blocks: list[weakref.ref[SparseMoeBlock]] = []  # handle -> block (one list per process)


class Router(nn.Module):
    """The gate: hidden -> one score per expert, as a plain matmul. Not an nn.Linear on
    purpose: load-time prepacking (cpu_linear.py) would move it to a kernel whose sums differ
    from transformers' in the last bits, and the top-k choice must be transformers' exactly."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class ExpertMLP(nn.Module):
    """One expert: silu(gate(x)) * up(x) -> down, LlamaMLP's modules at the expert's size."""

    def __init__(self, hidden: int, size: int) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, [size, size], bias=False, feeds_silu_mul=True)
        self.down_proj = nn.Linear(size, hidden, bias=False)

    forward = LlamaMLP.forward


@dataclass(frozen=True)
class FusedExperts:
    """Every expert's packed weights for switchyard_cpu::bf16_moe_block, stacked [E, ...]."""

    gate_up: torch.Tensor
    down: torch.Tensor


def fused_experts(experts: nn.ModuleList) -> FusedExperts | None:
    """The experts' packed weights stacked, where each runs our bf16 kernel throughout (gate /
    up packed for silu_mul, down without bias), else None: the Python loop runs them. Each
    linear keeps a view of its stacked weight, so the weights are held once."""
    firsts, seconds = [e.gate_up_proj for e in experts], [e.down_proj for e in experts]
    for first, second in zip(firsts, seconds, strict=True):
        if not (isinstance(first, PrepackedLinear) and first.kernel == "bf16"
                and first.fuses_silu_mul and first.bias is None
                and isinstance(second, PrepackedLinear) and second.kernel == "bf16"
                and not second.fuses_silu_mul and second.bias is None):
            return None
    return FusedExperts(_stacked(firsts), _stacked(seconds))


def _stacked(linears: list[PrepackedLinear]) -> torch.Tensor:
    stacked = torch.stack([linear.packed for linear in linears])
    for index, linear in enumerate(linears):
        linear.packed = stacked[index]
    return stacked


class SparseMoeBlock(nn.Module):
    """`renormalize`: divide the top-k weights by their sum; `float32_weights`: apply them in
    float32 (Mixtral's router returns them so; Qwen3-MoE's and OLMoE's cast them to the
    hidden dtype first)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, expert_size: int,
                 renormalize: bool, float32_weights: bool = False) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.float32_weights = renormalize, float32_weights
        self.gate = Router(hidden, num_experts)
        self.experts = nn.ModuleList(ExpertMLP(hidden, expert_size) for _ in range(num_experts))
        # Tokens routed to each expert since load (a token counts once per chosen expert).
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.long),
                             persistent=False)
        _blocks.append(weakref.ref(self))
        with torch.device("cpu"):  # a plain attribute: survives building on the meta device
            self.handle = torch.tensor(len(_blocks) - 1)
        # Decided on the first call (prepack_linears swaps the experts' linears after
        # construction), the packed weights kept; None: the Python loop runs them. Experts
        # replaced after that call are seen once `fused_decided` is reset.
        self.fused: FusedExperts | None = None
        self.fused_decided = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.switchyard.moe_block(x, self.handle)
        return self.route_and_run(x)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k expert weights [T, k] and indices [T, k], as transformers'
        routers compute them."""
        logits = self.gate(x)
        probs = nn.functional.softmax(logits, dim=-1, dtype=torch.float32)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float32_weights:
            weights = weights.to(logits.dtype)
        return weights, indices

    def route_and_run(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output [T, H]: each chosen expert runs once on its own tokens."""
        if self.uses_fused_experts():
            assert self.fused is not None
            return torch.ops.switchyard_cpu.bf16_moe_block(
                x, self.gate(x), self.fused.gate_up, self.fused.down, self.top_k,
                self.renormalize, self.float32_weights, self.expert_tokens)
        tokens = x.shape[0]
        if tokens == 0:
            return torch.zeros_like(x)
        weights, indices = self.route(x)
        # Flattened k-major ([k, T]) and stably sorted by expert: each expert's rows come in
        # transformers' order (by top-k slot, then token), and one index_add_ in that order
        # sums each token's experts as transformers' loop over experts does.
        flat = indices.t().reshape(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.expert_tokens += counts
        token_of = order % tokens
        grouped = x.index_select(0, token_of)
        y = self.run_experts(grouped, counts.tolist())
        scaled = y * weights.t().reshape(-1).index_select(0, order)[:, None]
        return torch.zeros_like(x).index_add_(0, token_of, scaled.to(x.dtype))

    def uses_fused_experts(self) -> bool:
        """Whether the block runs in one C++ call (decided once, on the first call)."""
        if not self.fused_decided:
            self.fused, self.fused_decided = fused_experts(self.experts), True
        return self.fused is not None

    def run_experts(self, grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each expert on its rows of `grouped` (grouped by expert, `counts` rows each)."""
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                outputs.append(self.experts[expert](grouped[start:start + count]))
                start += count
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


@torch.library.custom_op("switchyard::moe_block", mutates_args=())
def moe_block(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    block = _blocks[int(handle)]()
    assert block is not None, "the MoE block of this handle was freed"
    return block.route_and_run(x)


@moe_block.register_fake
def _(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def moe_blocks(model: nn.Module) -> Iterator[SparseMoeBlock]:
    return (module for module in model.modules() if isinstance(module, SparseMoeBlock))


def routed_tokens(blocks: list[SparseMoeBlock]) -> tuple[int, ...]:
    """Tokens routed to each expert since load, summed over the blocks (MoE layers)."""
    if not blocks:
        return ()
    return tuple(torch.stack([block.expert_tokens for block in blocks]).sum(0).tolist())


def expert_bytes(model: nn.Module) -> int:
    """Resident bytes of the model's expert weights (quantized ones as packed)."""
    return sum(resident_bytes(block.experts) for block in moe_blocks(model))


class MoECausalLM:
    """Mixed into an MoE model class: the experts' checkpoint names, and the routing counts
    zeroed when the model is materialized (`to_empty` leaves buffers uninitialized)."""

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> nn.Module:
        model = super().to_empty(device=device, recurse=recurse)  # type: ignore[misc]
        for block in moe_blocks(model):
            block.expert_tokens.zero_()
        return model

    def expert_linears(self, layer: int, block: str, names: tuple[str, str, str],
                       ) -> dict[str, list[str]]:
        """An MoE layer's expert Linears -> their checkpoint prefixes; `block` is the
        checkpoint's name of the MoE block, `names` its gate / up / down projections'."""
        mlp = self.model.layers[layer].mlp  # type: ignore[attr-defined]
        ours, theirs = f"model.layers.{layer}.mlp", f"model.layers.{layer}.{block}"
        gate, up, down = names
        targets: dict[str, list[str]] = {}
        for e in range(len(mlp.experts)):
            prefix = f"{theirs}.experts.{e}"
            targets[f"{ours}.experts.{e}.gate_up_proj"] = [f"{prefix}.{gate}", f"{prefix}.{up}"]
            targets[f"{ours}.experts.{e}.down_proj"] = [f"{prefix}.{down}"]
        return targets
