"""Tiny GGUF files for the tests: a random 2-layer Llama quantized by the gguf package itself,
with the default model's tokenizer metadata (so the engine can load it as any .gguf)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

T = GGMLQuantizationType
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
LAYER_STD, EMBED_STD = 0.08, 0.02
_BLOCK = {
    "attn_q": (HEADS * 64, HIDDEN), "attn_k": (KV_HEADS * 64, HIDDEN),
    "attn_v": (KV_HEADS * 64, HIDDEN), "attn_output": (HIDDEN, HEADS * 64),
    "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER),
}


def dequantized_copy(source: Path, path: Path) -> Path:
    """`source` with every tensor dequantized to float32 by the gguf package (its metadata and
    architecture as they are): the reference the kept file must match."""
    reader = GGUFReader(str(source))
    writer = GGUFWriter(str(path), str(reader.get_field("general.architecture").contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub)
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        writer.add_tensor(tensor.name, values.reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensor_bytes(path: Path) -> int:
    """The bytes of a file's tensors as stored."""
    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def _copy_tokenizer(writer: GGUFWriter, source: GGUFReader) -> int:
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub)
    return len(source.get_field("tokenizer.ggml.tokens").data)


def random_q4_k(rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Valid Q4_K blocks (the gguf package dequantizes Q4_K but cannot quantize to it)."""
    blocks = rows * cols // 256
    d = np.full(blocks, std / 20, np.float16).view(np.uint8).reshape(blocks, 2)
    dmin = np.full(blocks, std / 8, np.float16).view(np.uint8).reshape(blocks, 2)
    rest = rng.integers(0, 256, (blocks, 140), dtype=np.uint8)
    return np.concatenate([d, dmin, rest], axis=1).reshape(rows, -1)


def _f16_bytes(value: float, count: int) -> np.ndarray:
    return np.full(count, value, np.float16).view(np.uint8).reshape(count, 2)


def random_q5_k(rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Valid Q5_K blocks (d, dmin, 12 bytes of scales / mins, 32 of fifth bits, 128 of
    nibbles), random codes at about `std`."""
    blocks = rows * cols // 256
    rest = rng.integers(0, 256, (blocks, 172), dtype=np.uint8)
    return np.concatenate([_f16_bytes(std / 290, blocks), _f16_bytes(std / 19, blocks), rest],
                          axis=1).reshape(rows, -1)


def random_q6_k(rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Valid Q6_K blocks (128 bytes of low nibbles, 64 of high bits, 16 int8 scales, d)."""
    blocks = rows * cols // 256
    rest = rng.integers(0, 256, (blocks, 208), dtype=np.uint8)
    return np.concatenate([rest, _f16_bytes(std / 1200, blocks)], axis=1).reshape(rows, -1)


def random_q3_k(rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Valid Q3_K blocks (a type no kernel of ours takes)."""
    blocks = rows * cols // 256
    rest = rng.integers(0, 256, (blocks, 108), dtype=np.uint8)
    return np.concatenate([rest, _f16_bytes(std / 40, blocks)], axis=1).reshape(rows, -1)


_RANDOM = {T.Q3_K: random_q3_k, T.Q4_K: random_q4_k, T.Q5_K: random_q5_k, T.Q6_K: random_q6_k}


def blocks(values: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """`values` quantized to `qtype` by the gguf package, or random valid blocks of about
    their spread for the k-quants it cannot quantize to."""
    if qtype in _RANDOM:
        return _RANDOM[qtype](*values.shape, float(values.std()), rng)
    return quantize(values, qtype)


def _tensor(
    writer: GGUFWriter, name: str, values: np.ndarray, qtype: T, rng: np.random.Generator,
) -> None:
    if qtype in (T.F32, T.F16):
        writer.add_tensor(name, values.astype(np.float32 if qtype == T.F32 else np.float16))
    else:
        writer.add_tensor(name, blocks(values, qtype, rng), raw_dtype=qtype)


def write_tiny_gguf(
    path: Path, tokenizer_gguf: str, linear_type: Callable[[str], T], embed_type: T = T.Q8_0,
    seed: int = 0, layer_type: Callable[[str, int], T] | None = None,
) -> Path:
    """`linear_type(gguf tensor stem)` picks each linear's type ("attn_q", "ffn_down", ...);
    `layer_type(stem, layer)`, where given, picks per layer instead."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    vocab = _copy_tokenizer(writer, GGUFReader(tokenizer_gguf))
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    embed = rng.normal(0, EMBED_STD, (vocab, HIDDEN)).astype(np.float32)
    _tensor(writer, "token_embd.weight", embed, embed_type, rng)
    _tensor(writer, "output_norm.weight", np.ones(HIDDEN, np.float32), T.F32, rng)
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            _tensor(writer, f"blk.{layer}.{norm}.weight", np.ones(HIDDEN, np.float32), T.F32,
                    rng)
        for stem, shape in _BLOCK.items():
            values = rng.normal(0, LAYER_STD, shape).astype(np.float32)
            kind = layer_type(stem, layer) if layer_type else linear_type(stem)
            _tensor(writer, f"blk.{layer}.{stem}.weight", values, kind, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
