"""The checkpoint of `bench/real_size.py`: a random Qwen3 of a ~1.5B model's shapes as a bf16
Hugging Face folder and as GGUF files (bf16 by llama.cpp's `convert_hf_to_gguf.py`, then
`Q8_0` and `Q4_K_M` by its `llama-quantize`), cached under bench/.models/ (git-ignored), and
the weight bytes each format reads per token.

The tokenizer is Qwen2's BPE (151,643 tokens, 3 control tokens, 290 `[PAD…]` up to 151,936),
from the vocabulary file llama.cpp ships (`models/ggml-vocab-qwen2.gguf`) via transformers.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import peers

MODELS = peers.ROOT / "bench" / ".models"
FORMATS = ("bf16", "q8_0", "q4_k_m")
QUANTIZE_TYPES = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}
VOCAB_FILE = "ggml-vocab-qwen2.gguf"  # under the vendored llama.cpp's models/
PROMPT_VOCAB = 151643  # ids below this are ordinary BPE tokens (then control, then pads)
INIT_STD = 0.02  # small random weights keep activations in range through 28 layers


@dataclass(frozen=True)
class Shape:
    """A Qwen3's sizes: Qwen2.5-1.5B's hidden / MLP widths with Qwen3-1.7B's attention (16
    query heads and 8 KV heads of 128, q / k norms), 28 layers, tied embeddings."""

    hidden: int = 1536
    intermediate: int = 8960
    layers: int = 28
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 151936

    @property
    def name(self) -> str:
        return "qwen3-1.5b" if self.layers == Shape.layers else f"qwen3-1.5b-{self.layers}l"

    def parameters(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden + 2 * \
            self.head_dim
        return self.layers * layer + self.vocab * self.hidden + self.hidden


@dataclass(frozen=True)
class Checkpoint:
    """The files of one shape: the bf16 folder and a GGUF file per format."""

    folder: Path
    gguf: dict[str, Path]

    def weight_bytes(self, fmt: str) -> int:
        return folder_weight_bytes(self.folder) if fmt == "bf16" else \
            gguf_weight_bytes(self.gguf[fmt])


def prepare(shape: Shape, formats: list[str], threads: int,
            log: Callable[[str], None] = print) -> Checkpoint:
    """The folder and the GGUF files `formats` need, made on first use (each written under a
    temporary name, then renamed: a run cut short leaves nothing half-written behind)."""
    root = MODELS / shape.name
    root.mkdir(parents=True, exist_ok=True)
    folder = root / "hf"
    if not (folder / "config.json").exists():
        log(f"writing the random checkpoint {folder} ({shape.parameters() / 1e9:.2f}B "
            "parameters, bf16) ...")
        write_checkpoint(folder, shape)
    ggufs: dict[str, Path] = {}
    bf16 = root / f"{shape.name}-bf16.gguf"
    if not bf16.exists():
        log(f"converting it to {bf16.name} (llama.cpp's convert_hf_to_gguf.py) ...")
        peers.convert_to_gguf(folder, "bf16", bf16, shape.vocab, "qwen2")
    ggufs["bf16"] = bf16
    for fmt in formats:
        if fmt in QUANTIZE_TYPES:
            out = root / f"{shape.name}-{fmt}.gguf"
            if not out.exists():
                log(f"quantizing to {out.name} (llama-quantize {QUANTIZE_TYPES[fmt]}) ...")
            ggufs[fmt] = peers.quantize_gguf(bf16, QUANTIZE_TYPES[fmt], out, threads)
    return Checkpoint(folder, ggufs)


def write_checkpoint(folder: Path, shape: Shape) -> None:
    """A random Qwen3ForCausalLM in bf16 (normal weights of std INIT_STD, norms at 1; seed 0:
    every run and machine gets the same weights) saved by transformers with the Qwen2
    tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging

    config = Qwen3Config(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab,
        tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1e6,
        rms_norm_eps=1e-6, initializer_range=INIT_STD, bos_token_id=151643,
        eos_token_id=151643, dtype="bfloat16")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 2 bytes a parameter from the start
    try:
        model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    del model
    source = vocab_source()
    logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer.save_pretrained(partial)
    partial.replace(folder)


def vocab_source() -> Path:
    return peers.llama_source_tree() / "models" / VOCAB_FILE


def folder_weight_bytes(folder: Path) -> int:
    """Bytes of every tensor in the folder's safetensors files (read from their headers). The
    tied embedding is stored once and counted once, as the lm_head that reads it whole."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        total += sum(end - start for key, entry in header.items() if key != "__metadata__"
                     for start, end in [entry["data_offsets"]])
    return total


def gguf_weight_bytes(path: Path) -> int:
    """Bytes a decode step reads: every tensor of the file, less the embedding table's rows a
    token does not read where a separate `output.weight` is the head (tied, the table is the
    head and is read whole)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    embedding = tensors.get("token_embd.weight")
    if embedding is not None and "output.weight" in tensors:
        rows = int(embedding.shape[-1])  # GGUF lists dimensions innermost first
        total -= int(embedding.n_bytes) * (rows - 1) // rows
    return total


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of the file have each GGML type (e.g. a Q4_K_M mix)."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for tensor in GGUFReader(str(path)).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts
