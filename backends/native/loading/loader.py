"""Checkpoints: a Hugging Face folder (safetensors, or .bin) or one .gguf file.

`load_checkpoint` reads the config, refuses what the engine cannot honour, and hands back a
`Checkpoint` whose `tensors()` streams weights one at a time under Hugging Face names.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from safetensors import safe_open

from backends.base import NO_SAMPLING_DEFAULTS, SamplingDefaults
from backends.generation_config import read_generation_config, sampling_defaults
from backends.native.loading import gguf_reader
from backends.native.loading.startup_cache import StartupCache, reader_version
from backends.native.models.support import UnsupportedModelError, check_supported

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "UnsupportedModelError",
    "check_supported",
    "load_checkpoint",
    "weight_files",
]

CheckpointFormat = Literal["safetensors", "gguf", "pytorch"]

# keep_quantized: GGUF only, yield quantizable Linear weights as `GGUFRaw` blocks
TensorStream = Callable[[bool], Iterator[tuple[str, Any]]]


class CheckpointError(ValueError):
    """The path is not a checkpoint we can read (missing, no weights, bad config)."""


@dataclass
class Checkpoint:
    path: str  # folder or .gguf file
    config: transformers.PretrainedConfig
    format: CheckpointFormat
    generation_eos_token_ids: list[int]
    _stream: TensorStream = field(repr=False)
    # GGUF only: the file's scalar metadata (e.g. "tokenizer.ggml.add_bos_token"); {} for folders.
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)
    # GGUF only: the lm_head's blocks (output.weight, or token_embd when tied) can stay packed
    quantized_lm_head: bool = False
    # GGUF only: config and metadata came from the startup cache (the file was not parsed)
    metadata_cached: bool = False
    # Folders only: what generation_config.json sets (a GGUF file carries none)
    sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS

    def tensors(self, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
        """(HF parameter name, tensor), one at a time. GGUF tensors are dequantized to float32,
        except, with `keep_quantized`, Linear weights of a kept type (`GGUFRaw` blocks)."""
        return self._stream(keep_quantized)


def load_checkpoint(path: str, cache: StartupCache | None = None) -> Checkpoint:
    """`cache`: GGUF files keep their parsed metadata there (parsing it takes seconds)."""
    if not os.path.exists(path):
        raise CheckpointError(f"Checkpoint path does not exist: {path}")
    if os.path.isdir(path):
        return _load_folder(path)
    if path.endswith(".gguf"):
        cached = _gguf_from_cache(path, cache) if cache is not None else None
        return cached or _load_gguf(path, cache)
    raise CheckpointError(
        f"Not a model folder or a .gguf file: {path} "
        "(give a Hugging Face model folder or a .gguf file)"
    )


def _load_folder(path: str) -> Checkpoint:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"No config.json in model folder {path}")
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"Cannot read the config in {path}: {exc}") from exc
    check_supported(config)
    fmt, files = _weight_files(path)
    stream = _safetensors_stream(files) if fmt == "safetensors" else _pytorch_stream(files)
    generation = read_generation_config(path)
    eos = _merge_ids(config.eos_token_id, generation.get("eos_token_id"))
    return Checkpoint(path, config, fmt, eos, stream,
                      sampling_defaults=sampling_defaults(generation))


def _load_gguf(path: str, cache: StartupCache | None = None) -> Checkpoint:
    reader = gguf_reader.open_gguf(path)
    config = gguf_reader.gguf_config(reader)
    check_supported(config)
    gguf_reader.check_tensor_types(reader)
    eos = _merge_ids(config.eos_token_id, gguf_reader.gguf_extra_eos_ids(reader))
    metadata = gguf_reader.scalar_metadata(reader)
    lm_head_kept = gguf_reader.lm_head_kept(reader)
    if cache is not None:  # written only once every check above has passed
        cache.write_json(_metadata_entry(), {
            "config": config.to_dict(), "eos": eos, "metadata": metadata,
            "quantized_lm_head": lm_head_kept,
        })
    return Checkpoint(path, config, "gguf", eos, _gguf_stream(path, config, reader), metadata,
                      lm_head_kept)


def _metadata_entry() -> str:
    return f"metadata-{reader_version()}.json"


def _gguf_from_cache(path: str, cache: StartupCache) -> Checkpoint | None:
    entry = cache.read(_metadata_entry(), _parse_metadata_entry)
    if entry is None:
        return None
    config, eos, metadata, lm_head_kept = entry
    check_supported(config)
    return Checkpoint(path, config, "gguf", eos, _gguf_stream(path, config), metadata,
                      lm_head_kept, metadata_cached=True)


def _parse_metadata_entry(
    file: Path,
) -> tuple[transformers.PretrainedConfig, list[int], dict[str, Any], bool]:
    entry = json.loads(file.read_text(encoding="utf-8"))
    config = gguf_reader.config_from_dict(entry["config"])
    eos = [int(i) for i in entry["eos"]]
    return config, eos, dict(entry["metadata"]), bool(entry["quantized_lm_head"])


def _gguf_stream(
    path: str, config: transformers.PretrainedConfig, reader: gguf_reader.GGUFReader | None = None,
) -> TensorStream:
    """Tensors from the file, parsed only when first asked for (a cached start may never)."""
    opened = [reader] if reader is not None else []

    def stream(keep_quantized: bool) -> Iterator[tuple[str, Any]]:
        if not opened:
            opened.append(gguf_reader.open_gguf(path))
        return gguf_reader.iter_gguf_tensors(opened[0], config, keep_quantized)

    return stream


def weight_files(path: str) -> list[str]:
    """A model folder's weight files, in the order they are read."""
    return _weight_files(path)[1]


def _weight_files(path: str) -> tuple[CheckpointFormat, list[str]]:
    files = _indexed_or_globbed(path, "model.safetensors.index.json", "*.safetensors")
    if files:
        return "safetensors", files
    files = _indexed_or_globbed(path, "pytorch_model.bin.index.json", "pytorch_model*.bin")
    if files:
        return "pytorch", files
    raise CheckpointError(
        f"No weights found in {path}: expected *.safetensors files (a checkpoint in another "
        "format must be converted to safetensors first)"
    )


def _indexed_or_globbed(path: str, index_name: str, pattern: str) -> list[str]:
    index = os.path.join(path, index_name)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
        return [os.path.join(path, name) for name in names]
    files = sorted(glob.glob(os.path.join(path, pattern)))
    # Mistral folders may also hold consolidated.safetensors (original names, same weights).
    preferred = [f for f in files if os.path.basename(f).startswith("model")]
    return preferred or files


def _safetensors_stream(files: list[str]) -> TensorStream:
    def stream(keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    return stream


def _pytorch_stream(files: list[str]) -> TensorStream:
    def stream(keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            del state

    return stream


def _merge_ids(*values: Any) -> list[int]:
    """Union of token ids given as None / int / list, first-seen order."""
    merged: list[int] = []
    for value in values:
        ids = [] if value is None else [value] if isinstance(value, int) else list(value)
        merged.extend(int(i) for i in ids if int(i) not in merged)
    return merged
