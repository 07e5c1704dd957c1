"""Mixture-of-experts GGUF files (qwen3moe, olmoe, llama with experts: Mixtral) as llama.cpp
writes them: the config (and its startup-cache round trip) and every tensor the reader yields
are the save_pretrained folder's (3D expert tensors split per expert, Mixtral's q / k rows
unpermuted); packed experts come as each expert's own blocks; variants the engine does not run
are refused at load; the engine on the GGUF gives transformers' greedy tokens on the folder,
and runs packed experts (Q8_0, Q6_K) near their dequantized copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize
from safetensors.torch import load_file

from backends.native.loading.gguf_reader import (
    config_from_dict,
    gguf_config,
    iter_gguf_tensors,
    open_gguf,
)
from backends.native.models.support import UnsupportedModelError
from backends.quantized import kquant_linear, q8_linear
from backends.quantized.gguf import FLOAT_REASON, GGUFRaw, gguf_formats
from backends.quantized.int4_linear import Int4Linear
from backends.quantized.kquant_linear import KQuantLinear
from backends.quantized.q8_linear import Q8Linear
from tests.native.models import moe_tiny
from tests.native.models.moe_gguf import write_moe_gguf
from tests.native.models.moe_tiny import moe_tweak
from tests.native.models.tiny import VOCAB, write_tiny
from tests.native.test_parity import (
    GREEDY,
    assert_all_blocks_free,
    make_engine,
    reference_greedy,
)
from tests.quantized.gguf_files import dequantized_copy
from tests.quantized.helpers import native_greedy

T = GGMLQuantizationType
CONFIGS = {"qwen3_moe": moe_tiny.qwen3_moe_config, "mixtral": moe_tiny.mixtral_config,
           "olmoe": moe_tiny.olmoe_config}
# The config fields the GGUF metadata must carry back (beside the shared ones).
MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
              "intermediate_size", "norm_topk_prob", "mlp_only_layers",
              "num_hidden_layers", "num_key_value_heads", "tie_word_embeddings")
# The packed file: gate / up experts Q8_0 (the gguf package quantizes the folder's weights),
# down experts Q6_K (random valid blocks: it cannot quantize to Q6_K), 256 in-features.
PACKED_TYPES = {"gate": T.Q8_0, "up": T.Q8_0, "down": T.Q6_K}
# Max |packed - dequantized copy| logit over 3 prompts x 4 greedy steps, logits up to 0.76:
# measured 1.0e-4 on AVX-512 (Q8_0 as two int4 halves) and 4.2e-5 on AVX2 (Q8Linear), the
# k-quant kernel's int8 inputs most of it; about 4x that. Each expert given its neighbour's
# blocks: 1.25.
PACKED_TOLERANCE = 4e-4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         tokenizer_dir: Path, default_gguf_path: str) -> tuple[str, Path, Path]:
    arch = request.param
    folder = write_tiny(tmp_path_factory.mktemp(arch), tokenizer_dir, CONFIGS[arch](),
                        tweak=moe_tweak)
    path = write_moe_gguf(folder / f"{arch}-f32.gguf", folder, default_gguf_path)
    return arch, folder, path


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path,
           default_gguf_path: str) -> tuple[Path, Path]:
    """qwen3_moe with experts of 256 (Q6_K's block): the packed file and its dequantized copy."""
    tmp = tmp_path_factory.mktemp("packed")
    folder = write_tiny(tmp / "hf", tokenizer_dir,
                        moe_tiny.qwen3_moe_config(moe_intermediate_size=256), tweak=moe_tweak)
    path = write_moe_gguf(tmp / "packed.gguf", folder, default_gguf_path,
                          expert_type=PACKED_TYPES.__getitem__)
    return path, dequantized_copy(path, tmp / "dequantized.gguf")


def test_config_and_tensors_are_the_folders(case: tuple[str, Path, Path], tmp_path: Path,
                                           default_gguf_path: str) -> None:
    arch, folder, path = case
    _check_config_and_tensors(folder, path)
    if arch == "mixtral":  # also as llama.cpp wrote Mixtral before stacking its experts
        _check_config_and_tensors(folder, write_moe_gguf(
            tmp_path / "per-expert.gguf", folder, default_gguf_path, stacked=False))


def _check_config_and_tensors(folder: Path, path: Path) -> None:
    reader = open_gguf(str(path))
    config = gguf_config(reader)
    want = transformers.AutoConfig.from_pretrained(folder)
    assert type(config) is type(want)
    for field in MOE_FIELDS:
        assert getattr(config, field, None) == getattr(want, field, None), field
    heads = want.hidden_size // want.num_attention_heads  # Mixtral's None, OLMoE's none
    assert (getattr(config, "head_dim", None) or heads) == \
        (getattr(want, "head_dim", None) or heads)
    assert config_from_dict(config.to_dict()).to_dict() == config.to_dict()  # startup cache
    tensors = dict(iter_gguf_tensors(reader, config))
    saved = load_file(str(folder / "model.safetensors"))
    assert sorted(tensors) == sorted(saved)
    for name, value in saved.items():
        assert torch.equal(tensors[name], value), name


def test_packed_experts_come_as_each_experts_blocks(packed: tuple[Path, Path]) -> None:
    path, _ = packed
    reader = open_gguf(str(path))
    config = gguf_config(reader)
    stored = {t.name: t for t in reader.tensors}
    raw = dict(iter_gguf_tensors(reader, config, keep_quantized=True))
    dense = dict(iter_gguf_tensors(reader, config))
    assert config.mlp_only_layers == [0] and config.moe_intermediate_size == 256
    for kind, qtype in PACKED_TYPES.items():
        tensor = stored[f"blk.1.ffn_{kind}_exps.weight"]
        whole = dequantize(tensor.data, qtype).reshape(8, *reversed(tensor.shape[:2].tolist()))
        for expert in range(8):
            name = f"model.layers.1.mlp.experts.{expert}.{kind}_proj.weight"
            weight = raw[name]
            assert isinstance(weight, GGUFRaw) and weight.qtype == qtype
            assert weight.shape == tuple(dense[name].shape)
            assert torch.equal(weight.dense(), dense[name])
            assert torch.equal(dense[name], torch.from_numpy(whole[expert]))
    assert isinstance(dense["model.layers.1.mlp.gate.weight"], torch.Tensor)  # router: float


def _edited(reader: GGUFReader, path: Path, arch: str | None = None, fields: dict | None = None,
            extra: dict[str, np.ndarray] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """`reader`'s file, its config metadata under another architecture name (its keys
    renamed), with fields set, tensors added or dropped."""
    old = str(reader.get_field("general.architecture").contents())
    writer = GGUFWriter(str(path), arch or old)
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or key == "general.architecture":
            continue  # the config needs no tokenizer (copying its arrays costs seconds)
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key.replace(f"{old}.", f"{arch or old}.", 1), field.contents(),
                             kind, sub)
    for key, (value, kind) in (fields or {}).items():
        writer.add_key_value(f"{arch or old}.{key}", value, kind)
    for tensor in reader.tensors:
        if tensor.name not in drop:
            raw = None if tensor.tensor_type == T.F32 else tensor.tensor_type
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=raw)
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_variants_are_refused(packed: tuple[Path, Path], tmp_path: Path) -> None:
    source = GGUFReader(str(packed[0]))  # parsed once: its tokenizer arrays take seconds
    shared = np.zeros((32, 64), np.float32)
    cases = {
        "shared experts": _edited(source, tmp_path / "shexp.gguf",
                                  extra={"blk.1.ffn_up_shexp.weight": shared}),
        "qwen2moe": _edited(source, tmp_path / "qwen2moe.gguf", arch="qwen2moe"),
        "expert_weights_scale 2.5": _edited(
            source, tmp_path / "scaled.gguf",
            fields={"expert_weights_scale": (2.5, GGUFValueType.FLOAT32)}),
        "expert_gating_func": _edited(
            source, tmp_path / "sigmoid.gguf",
            fields={"expert_gating_func": (2, GGUFValueType.UINT32)}),
        "layer 1 has no router with 8 gate / up / down experts nor a dense": _edited(
            source, tmp_path / "no-router.gguf", drop=("blk.1.ffn_gate_inp.weight",)),
    }
    for message, file in cases.items():
        with pytest.raises(UnsupportedModelError, match=message) as info:
            gguf_config(open_gguf(str(file)))
        assert "--backend transformers" in str(info.value)


def test_engine_on_the_gguf_matches_transformers(case: tuple[str, Path, Path]) -> None:
    """Eager: the model is the folder's, only its loading differs (and compiling costs)."""
    arch, folder, path = case
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 23, 11)]
    expected = reference_greedy(folder, prompts, GREEDY.max_tokens)
    engine = make_engine(path, compile=False)
    assert engine.loaded.hf_config.model_type == arch
    seqs = engine.generate(prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == expected
    assert_all_blocks_free(engine)


def test_packed_experts_run_near_their_dequantized_copy(packed: tuple[Path, Path]) -> None:
    """Each expert's gate_up_proj from Q8_0 blocks, its down_proj on the k-quant kernel."""
    cpu = torch.device("cpu")
    if not kquant_linear.available(cpu, torch.float32):
        pytest.skip("our CPU kernels do not run here")
    path, dense_path = packed
    kept = make_engine(path, compile=False)
    dense = make_engine(dense_path, compile=False)
    q8 = Q8Linear if q8_linear.available(cpu, torch.float32) else Int4Linear
    for expert in kept.loaded.model.model.layers[1].mlp.experts:
        assert isinstance(expert.gate_up_proj, q8) and isinstance(expert.down_proj, KQuantLinear)
    formats = gguf_formats(kept.loaded.model)
    assert formats.kept == ["Q6_K", "Q8_0"]
    assert {e.reason for e in formats.expanded} == {FLOAT_REASON}  # the F32 tensors only
    gen = torch.Generator().manual_seed(3)
    worst = 0.0
    for length in (12, 12, 40):
        prompt = torch.randint(3, VOCAB, (length,), generator=gen).tolist()
        want_tokens, want = native_greedy(dense, prompt, steps=4)
        tokens, got = native_greedy(kept, prompt, steps=4)
        same = 4 if tokens == want_tokens else 1  # later rows: only on the same tokens
        worst = max(worst, (got[:same] - want[:same]).abs().max().item())
    assert worst <= PACKED_TOLERANCE, worst
