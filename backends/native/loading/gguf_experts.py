"""Mixture-of-experts GGUF files: llama.cpp's qwen3moe, olmoe, and llama with experts
(Mixtral), as transformers' Qwen3MoeConfig / OlmoeConfig / MixtralConfig and HF tensor names.

llama.cpp's converter stacks each layer's experts into one 3D tensor per projection,
`blk.N.ffn_{gate,up,down}_exps.weight` ([n_expert, out, in] in torch order, so its data is
n_expert * out rows of blocks), and names the router `blk.N.ffn_gate_inp.weight`. Each 3D
tensor comes back here as one 2D tensor per expert under the names `save_pretrained` writes
(`mlp.experts.E.gate_proj`; Mixtral's `block_sparse_moe.experts.E.w1` / w3 / w2), dequantized
or, for a kept type, as that expert's rows of blocks. Mixtral files written before llama.cpp
stacked them hold one 2D tensor per expert, `blk.N.ffn_{gate,up,down}.E.weight`, named alike.

Routing as llama.cpp runs each architecture (whatever the file's metadata says): qwen3moe
renormalises the top-k weights (`norm_topk_prob`), olmoe does not, Mixtral always does. Expert
sizes as llama.cpp reads them: qwen3moe's `expert_feed_forward_length`, else
`feed_forward_length / expert_used_count`; olmoe's and llama's `feed_forward_length`.

A qwen3moe layer with plain `ffn_gate` / `ffn_up` / `ffn_down` tensors and no router is read
as one of Qwen3-MoE's dense `mlp_only_layers` (llama.cpp's converter cannot write one, its
qwen3moe tensor map has no dense FFN; its loader would refuse it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import transformers
from gguf import ExpertGatingFuncType, ReaderTensor
from gguf.quants import dequantize

from backends.native.models.support import UnsupportedModelError
from backends.quantized.gguf import KEPT_TYPES, GGUFRaw

MOE_ARCHITECTURES = ("olmoe", "qwen3moe")  # and llama with llama.expert_count > 0
ROUTER = "ffn_gate_inp.weight"
_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_PER_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
_SHARED_RE = re.compile(r"^blk\.\d+\.ffn_\w+_shexp\.weight$")
_DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_KINDS = ("gate", "up", "down")
_EXPERT_FFN = tuple(f"ffn_{kind}_exps.weight" for kind in _KINDS)
_HF_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_MIXTRAL_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}
ROUTER_NAMES = {"qwen3moe": "mlp.gate.weight", "olmoe": "mlp.gate.weight",
                "llama": "block_sparse_moe.gate.weight"}
Meta = Callable[..., Any]


def is_moe(arch: str, meta: Meta) -> bool:
    return arch in MOE_ARCHITECTURES or (arch == "llama" and int(meta("expert_count", 0) or 0) > 0)


def is_expert_tensor(gguf_name: str) -> bool:
    return _EXPERT_RE.match(gguf_name) is not None


def expert_hf_name(arch: str, gguf_name: str) -> str | None:
    """The HF name of one expert's 2D tensor (older Mixtral files), else None."""
    match = _PER_EXPERT_RE.match(gguf_name)
    if match is None:
        return None
    layer, kind, expert = match.groups()
    return _hf_name(arch, layer, int(expert), kind)


def _hf_name(arch: str, layer: str, expert: int, kind: str) -> str:
    """Mixtral's checkpoint names (`block_sparse_moe.experts.E.w1`), else Qwen3-MoE's and
    OLMoE's (`mlp.experts.E.gate_proj`)."""
    if arch == "llama":
        proj, block = _MIXTRAL_PROJ[kind], "block_sparse_moe"
    else:
        proj, block = _HF_PROJ[kind], "mlp"
    return f"model.layers.{layer}.{block}.experts.{expert}.{proj}.weight"


def moe_config(arch: str, meta: Meta, kwargs: dict[str, Any], head_dim: int,
               names: set[str]) -> transformers.PretrainedConfig:
    """The transformers config of an MoE file (`kwargs`: what every architecture shares),
    once `refuse_variants` has passed."""
    experts = int(meta("expert_count", 0) or 0)
    used = int(meta("expert_used_count", 0) or 0)
    if experts <= 0 or not 0 < used <= experts:
        raise UnsupportedModelError(
            f"GGUF {arch} file declares {experts} experts, {used} used per token; need "
            "expert_count > 0 and 0 < expert_used_count <= expert_count.")
    dense = _dense_layers(arch, names, kwargs["num_hidden_layers"], experts)
    if arch == "qwen3moe":
        size = int(meta("expert_feed_forward_length", 0) or kwargs["intermediate_size"] // used)
        return transformers.Qwen3MoeConfig(
            head_dim=head_dim, num_experts=experts, num_experts_per_tok=used,
            moe_intermediate_size=size, mlp_only_layers=dense, decoder_sparse_step=1,
            norm_topk_prob=True, **kwargs)
    if arch == "olmoe":
        clamp = meta("attention.clamp_kqv")
        return transformers.OlmoeConfig(
            num_experts=experts, num_experts_per_tok=used, clip_qkv=float(clamp) if clamp else None,
            norm_topk_prob=False, **kwargs)
    return transformers.MixtralConfig(head_dim=head_dim, num_local_experts=experts,
                                      num_experts_per_tok=used, sliding_window=None, **kwargs)


def refuse_variants(arch: str, meta: Meta, names: set[str]) -> None:
    """MoE variants llama.cpp writes under these architectures that the models do not run."""
    shared = sorted(n for n in names if _SHARED_RE.match(n) or "_inp_shexp" in n)
    if shared or int(meta("expert_shared_count", 0) or 0):
        shown = ", ".join(shared[:3]) or "expert_shared_count"
        raise UnsupportedModelError(
            f"GGUF {arch} file has shared experts ({shown}), which the native engine does not "
            "run; use --backend transformers.")
    scale = float(meta("expert_weights_scale", 0.0) or 0.0)
    if scale not in (0.0, 1.0):  # llama.cpp: 0 is none
        raise UnsupportedModelError(
            f"GGUF {arch} expert_weights_scale {scale} is not supported (routing weights are "
            "not scaled); use --backend transformers.")
    gating = meta("expert_gating_func")
    if gating is not None and int(gating) != ExpertGatingFuncType.SOFTMAX:
        raise UnsupportedModelError(
            f"GGUF {arch} expert_gating_func {int(gating)} is not supported (softmax routing "
            "only); use --backend transformers.")


def _dense_layers(arch: str, names: set[str], layers: int, experts: int) -> list[int]:
    """Layers without a router: each must hold the dense FFN, and only qwen3moe has any."""
    dense = []
    split = {f"ffn_{kind}.{e}.weight" for kind in _KINDS for e in range(experts)}
    for layer in range(layers):
        prefix = f"blk.{layer}."
        stems = {n.removeprefix(prefix) for n in names if n.startswith(prefix)}
        if ROUTER in stems and (set(_EXPERT_FFN) <= stems or split <= stems):
            continue
        if arch == "qwen3moe" and ROUTER not in stems and set(_DENSE_FFN) <= stems:
            dense.append(layer)
            continue
        raise UnsupportedModelError(
            f"GGUF {arch} layer {layer} has no router with {experts} gate / up / down experts"
            f"{' nor a dense gate / up / down' if arch == 'qwen3moe' else ''}; use "
            "--backend transformers.")
    return dense


def expert_weights(
    tensor: ReaderTensor, arch: str, keep_quantized: bool,
) -> Iterator[tuple[str, torch.Tensor | GGUFRaw]]:
    """One 3D expert tensor as (HF name, weight) per expert: float32 [out, in], or with
    `keep_quantized` and a kept type that expert's blocks."""
    match = _EXPERT_RE.match(tensor.name)
    if match is None:
        raise UnsupportedModelError(f"Not a GGUF expert tensor: {tensor.name}")
    layer, kind = match.groups()
    in_features, out_features, n_expert = (int(d) for d in tensor.shape.tolist())
    keep = keep_quantized and tensor.tensor_type in KEPT_TYPES
    data = tensor.data.reshape(n_expert, out_features, -1)
    for expert in range(n_expert):
        name = _hf_name(arch, layer, expert, kind)
        if keep:
            blocks = torch.from_numpy(np.array(data[expert], dtype=np.uint8, copy=True))
            yield name, GGUFRaw(f"{tensor.name}[{expert}]", tensor.tensor_type, blocks,
                                in_features)
        else:
            values = dequantize(data[expert], tensor.tensor_type)
            array = np.array(values, dtype=np.float32, copy=True)
            yield name, torch.from_numpy(array.reshape(out_features, in_features))
