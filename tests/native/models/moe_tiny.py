"""Tiny mixture-of-experts configs (hidden 64, 2 layers, 8 experts, top-2) for the MoE tests,
shared by the safetensors and GGUF tests; `write_tiny` (tiny.py) saves a random model of one,
`write_gptq_int4` a 4-bit GPTQ checkpoint of it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.native.models.tiny import TINY

EXPERTS = {"num_experts_per_tok": 2}
EXPERT_SIZE = 32


def qwen3_moe_config(**overrides: object) -> transformers.Qwen3MoeConfig:
    """Layer 0 dense (mlp_only_layers, intermediate 128), layer 1 sparse (experts of 32);
    head_dim 32 beside hidden 64 / 4 heads; the top-k weights renormalised."""
    options = {**TINY, **EXPERTS, "num_experts": 8, "moe_intermediate_size": EXPERT_SIZE,
               "head_dim": 32, "mlp_only_layers": [0], "decoder_sparse_step": 1,
               "norm_topk_prob": True, "tie_word_embeddings": False, **overrides}
    return transformers.Qwen3MoeConfig(**options)


def mixtral_config(**overrides: object) -> transformers.MixtralConfig:
    """Every layer sparse, experts of intermediate_size (32)."""
    options = {**TINY, **EXPERTS, "num_local_experts": 8, "intermediate_size": EXPERT_SIZE,
               **overrides}
    return transformers.MixtralConfig(**options)


def olmoe_config(**overrides: object) -> transformers.OlmoeConfig:
    """Every layer sparse, experts of intermediate_size (32), top-k weights not renormalised
    (OLMoE's norm_topk_prob=False)."""
    options = {**TINY, **EXPERTS, "num_experts": 8, "intermediate_size": EXPERT_SIZE,
               "norm_topk_prob": False, "pad_token_id": 0, "eos_token_id": 2, **overrides}
    return transformers.OlmoeConfig(**options)


def moe_tweak(name: str, param: torch.nn.Parameter) -> None:
    """For `write_tiny`: a router 8x and experts 4x transformers' init scale, so that routing is
    decisive (no near-tie of the k-th and next expert to flip on rounding) and the experts'
    output weighs in the residual stream as much as attention's; q / k norm weights away from
    1, so that a norm over the wrong span shows."""
    if name.endswith("mlp.gate.weight"):
        param.mul_(8)
    elif ".experts." in name:
        param.mul_(4)
    elif name.endswith(("q_norm.weight", "k_norm.weight")):
        param.uniform_(0.3, 2.5)


GPTQ_GROUP = 32
# Linears the GPTQ writer quantizes: every projection but the router and the lm_head.
GPTQ_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "w1", "w2", "w3")


def write_gptq_int4(folder: Path, out: Path, dequantized: bool = False) -> Path:
    """`folder`'s model as a GPTQ v1 checkpoint (4-bit, symmetric, group 32, no act-order),
    each linear rounded to nearest: what the engine's int4 loaders read. `dequantized`: the
    same rounded weights stored dense (float32, no quantization_config), its exact reference."""
    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    written: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if suffix != "weight" or prefix.rpartition(".")[2] not in GPTQ_LINEARS:
            written[name] = tensor
            continue
        q, scales = _round(tensor)
        if dequantized:
            written[name] = ((q - 8).float() * scales.float().repeat_interleave(GPTQ_GROUP, 0)).t()
        else:
            written.update({f"{prefix}.{k}": v for k, v in _gptq_tensors(q, scales).items()})
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    if not dequantized:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = {
            "quant_method": "gptq", "bits": 4, "group_size": GPTQ_GROUP, "sym": True,
            "desc_act": False, "checkpoint_format": "gptq"}
        (out / "config.json").write_text(json.dumps(config))
    return out


def _round(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> q [K, N] in 0..15 and fp16 scales [G, N]: w ~ (q - 8) * scale."""
    n, k = weight.shape
    groups = weight.float().t().reshape(k // GPTQ_GROUP, GPTQ_GROUP, n)
    scales = (groups.abs().amax(dim=1) / 7).clamp(min=1e-8).half()
    q = (groups / scales.float()[:, None]).round().clamp(-8, 7).long() + 8
    return q.reshape(k, n), scales


def _gptq_tensors(q: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """qweight [K/8, N], qzeros [G, N/8] (zero 8 stored as 7), scales, g_idx [K]."""
    k, n = q.shape
    shifts = (torch.arange(8) * 4).view(1, 8, 1)
    qweight = (q.view(k // 8, 8, n) << shifts).sum(dim=1)
    zeros = torch.full((k // GPTQ_GROUP, n // 8, 8), 7, dtype=torch.long)
    qzeros = (zeros << shifts.view(1, 1, 8)).sum(dim=2)
    return {"qweight": _int32(qweight), "qzeros": _int32(qzeros), "scales": scales,
            "g_idx": torch.arange(k, dtype=torch.int32) // GPTQ_GROUP}


def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> int32 of the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
