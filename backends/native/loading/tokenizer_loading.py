"""Loads a checkpoint's tokenizer: a folder's saved tokenizer, or a GGUF file's converted one.

For GGUF files the tokenizer comes from transformers' GGUF conversion, corrected where it
disagrees with the file's own metadata (special token ids, add_bos/add_eos, no space
clean-up), so we tokenize the way llama.cpp does.
"""

from __future__ import annotations

import os
from pathlib import Path

import transformers

from backends.native.loading.loader import Checkpoint
from backends.native.loading.startup_cache import StartupCache, reader_version
from backends.text.tokenizer import Tokenizer

_NO_TRANSFORMERS_CONFIG = ("olmoe",)


def load_tokenizer(checkpoint: Checkpoint, cache: StartupCache | None = None) -> Tokenizer:
    """`cache`: a GGUF file's converted tokenizer is kept there (converting takes seconds)."""
    cached = None
    if checkpoint.format == "gguf":
        entry = f"tokenizer-{reader_version()}"
        cached = cache.read(entry, _load_saved) if cache is not None else None
        hf = cached or _load_gguf_tokenizer(checkpoint)
        if cache is not None and cached is None:
            cache.publish(entry, hf.save_pretrained)
    else:
        hf = transformers.AutoTokenizer.from_pretrained(
            checkpoint.path, use_fast=True, local_files_only=True
        )
    tokenizer = Tokenizer(hf, checkpoint.generation_eos_token_ids)
    tokenizer.from_cache = cached is not None
    return tokenizer


def _load_saved(folder: Path) -> transformers.PreTrainedTokenizerBase:
    """A tokenizer as `save_pretrained` wrote it: its fixes to the GGUF conversion included."""
    if not (folder / "tokenizer.json").is_file():
        raise ValueError("no tokenizer.json")
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _load_gguf_tokenizer(checkpoint: Checkpoint) -> transformers.PreTrainedTokenizerBase:
    folder, name = os.path.split(os.path.abspath(checkpoint.path))
    # AutoTokenizer first reads the file's config, refused for architectures transformers'
    # GGUF loader lacks; the tokenizer itself is the file's tokenizer.ggml.* fields alone.
    auto = checkpoint.metadata.get("general.architecture") not in _NO_TRANSFORMERS_CONFIG
    loader = transformers.AutoTokenizer if auto else transformers.PreTrainedTokenizerFast
    hf = loader.from_pretrained(folder, gguf_file=name, local_files_only=True)
    meta = checkpoint.metadata
    for attr, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ):
        if key in meta:
            setattr(hf, attr, hf.convert_ids_to_tokens(int(meta[key])))
    for attr, key in (
        ("add_bos_token", "tokenizer.ggml.add_bos_token"),
        ("add_eos_token", "tokenizer.ggml.add_eos_token"),
    ):
        if key in meta and hasattr(hf, attr):
            setattr(hf, attr, bool(meta[key]))
    hf.clean_up_tokenization_spaces = False
    template = meta.get("tokenizer.chat_template")
    if template and hf.chat_template != template:
        hf.chat_template = template
    return hf
