"""Plain reference dequantization of GPTQ v1 and AWQ GEMM tensors, written from the formats'
descriptions and independent of backends/quantized, element by element in int64."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaForCausalLM

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _nibble(word: torch.Tensor, index: int, bits: int) -> torch.Tensor:
    return (word.long() >> (bits * index)) & ((1 << bits) - 1)


def gptq_dense(t: dict[str, torch.Tensor], prefix: str, bits: int) -> torch.Tensor:
    qweight, qzeros = t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"]
    scales, g_idx = t[f"{prefix}.scales"].float(), t[f"{prefix}.g_idx"].long()
    per = 32 // bits
    k, n = qweight.shape[0] * per, qweight.shape[1]
    q = torch.empty(k, n, dtype=torch.long)
    for row in range(k):
        q[row] = _nibble(qweight[row // per], row % per, bits)
    zeros = torch.empty(scales.shape, dtype=torch.long)
    for col in range(n):
        zeros[:, col] = _nibble(qzeros[:, col // per], col % per, bits) + 1
    w = (q - zeros[g_idx]).float() * scales[g_idx]  # [K, N]
    return w.t()


def awq_dense(t: dict[str, torch.Tensor], prefix: str, group: int) -> torch.Tensor:
    qweight, qzeros = t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"]
    scales = t[f"{prefix}.scales"].float()
    k, n = qweight.shape[0], qweight.shape[1] * 8
    q = torch.empty(k, n, dtype=torch.long)
    zeros = torch.empty(scales.shape, dtype=torch.long)
    for i, column in enumerate(AWQ_ORDER):
        q[:, column::8] = _nibble(qweight, i, 4)
        zeros[:, column::8] = _nibble(qzeros, i, 4)
    g = torch.arange(k) // group
    return ((q - zeros[g]).float() * scales[g]).t()


def dense_model(folder: Path, dequantize) -> LlamaForCausalLM:
    """The fixture as a dense bf16 transformers model, Linears from `dequantize(t, prefix)`."""
    config = AutoConfig.from_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    state = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0].split(".")[-1] not in LINEARS}
    for layer in range(config.num_hidden_layers):
        for block, names in (("self_attn", LINEARS[:4]), ("mlp", LINEARS[4:])):
            for name in names:
                prefix = f"model.layers.{layer}.{block}.{name}"
                dense = tensors.get(f"{prefix}.weight")  # left unquantized by the checkpoint
                state[f"{prefix}.weight"] = dequantize(tensors, prefix) if dense is None else dense
    if "lm_head.qweight" in tensors:  # GPTQ with a quantized lm_head
        state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
        state["lm_head.weight"] = dequantize(tensors, "lm_head")
    model = LlamaForCausalLM(config)
    model.load_state_dict(state, strict=True)
    return model.to(torch.bfloat16).eval()
