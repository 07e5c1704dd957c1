"""GPTQ v1 and AWQ GEMM checkpoints of a dense folder, by round-to-nearest, for benchmarks.

Speed depends on the format (packing, bits, group size), not on how the integers were chosen,
so plain RTN stands in for the GPTQ / AWQ algorithms (whose libraries do not install beside
this project's transformers). The tests use checkpoints made by the real libraries.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32 bits -> the same bits as int32."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit values -> int32 [R / 8, C], row 8 r + j in bits 4 j of word r."""
    words = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int64)
    for j in range(8):
        words |= q[j::8].long() << (4 * j)
    return _to_int32(words)


def _pack_cols(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] 4-bit values -> int32 [R, C / 8], column 8 c + order[j] in bits 4 j of word c."""
    words = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for j, column in enumerate(order):
        words |= q[:, column::8].long() << (4 * j)
    return _to_int32(words)


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    return w.float().view(n, k // group, group)


def gptq_sym(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """GPTQ v1, 4-bit symmetric (zero point 8, stored as 7), no act order."""
    wg = _groups(w, group)
    scale = (2 * wg.abs().amax(-1) / 15).clamp(min=1e-8)  # [N, G]
    q = (torch.round(wg / scale.unsqueeze(-1)) + 8).clamp(0, 15).view(w.shape).long()
    zeros = torch.full_like(scale, 7, dtype=torch.long)
    k = w.shape[1]
    return {
        "qweight": _pack_rows(q.t().contiguous()),
        "qzeros": _pack_cols(zeros.t().contiguous()),
        "scales": scale.t().contiguous().half(),
        "g_idx": (torch.arange(k) // group).to(torch.int32),
    }


def awq_gemm(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """AWQ GEMM, 4-bit with zero points (min / max per group)."""
    wg = _groups(w, group)
    low, high = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    scale = ((high - low) / 15).clamp(min=1e-8)
    zero = torch.round(-low / scale).clamp(0, 15)
    q = (torch.round(wg / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, 15)
    q = q.view(w.shape).long()
    return {
        "qweight": _pack_cols(q.t().contiguous(), AWQ_ORDER),
        "qzeros": _pack_cols(zero.long().t().contiguous(), AWQ_ORDER),
        "scales": scale.t().contiguous().half(),
    }


def write_quantized(dense: Path, out: Path, method: str, group: int = 128) -> Path:
    """A copy of `dense` (safetensors + config + tokenizer) with its Linears packed."""
    shutil.copytree(dense, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(dense.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    packed: dict[str, torch.Tensor] = {}
    pack = gptq_sym if method == "gptq" else awq_gemm
    for name, tensor in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix.rsplit(".", 1)[-1] in LINEARS:
            packed.update({f"{prefix}.{k}": v for k, v in pack(tensor, group).items()})
        else:
            packed[name] = tensor
    save_file(packed, str(out / "model.safetensors"))
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True,
         "desc_act": False, "checkpoint_format": "gptq"}
        if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"}
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
