"""Loads any model transformers can: AutoModelForCausalLM + AutoTokenizer from a local path.

A folder or a .gguf file (transformers dequantizes GGUF weights at load). Hub downloads are
unavailable, so ids that are not local paths are refused (resolve_model_path's message).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from backends.base import NO_SAMPLING_DEFAULTS, SamplingDefaults
from backends.default_model import checkpoint_sampling, resolve_model_path
from backends.generation_config import read_generation_config, sampling_defaults
from backends.machine.cpu_dtype import choose_dtype
from backends.text.tokenizer import Tokenizer
from backends.transformers.options import TransformersOptions

log = logging.getLogger(__name__)

DEFAULT_MAX_TOTAL_TOKENS = 4096
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class LoadedHF:
    path: str
    model: transformers.PreTrainedModel
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str
    vocab_size: int  # the larger of the tokenizer's and the model's
    max_input_tokens: int
    max_total_tokens: int
    quantization: str | None
    sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS  # the checkpoint's own


def load(model_id: str, options: TransformersOptions) -> LoadedHF:
    path = resolve_model_path(model_id)
    folder, gguf_file = _split_path(path)
    device = _device(options.device)
    choice = choose_dtype(_DTYPES.get(options.dtype), device)
    extra: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    hf_tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **extra)
    log.info("loading %s with transformers (%s on %s)", path, choice.name, device)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=choice.dtype, local_files_only=True, **extra
    )
    model = model.to(device).eval()
    eos = _merge_ids(model.config.get_text_config().eos_token_id,
                     model.generation_config.eos_token_id)
    # Every generation choice comes from the request: the checkpoint's defaults (sampling,
    # eos, penalties in generation_config.json) must not leak into `generate`; its sampling
    # defaults reach requests through the gateway instead (ModelInfo.sampling_defaults).
    model.generation_config = GenerationConfig()
    max_input, max_total = _limits(model.config, options)
    return LoadedHF(
        path=path, model=model, tokenizer=Tokenizer(hf_tokenizer, eos), device=device,
        dtype=choice.dtype, dtype_reason=choice.reason,
        vocab_size=model.get_input_embeddings().num_embeddings,  # an id past it cannot run
        max_input_tokens=max_input, max_total_tokens=max_total,
        quantization="gguf (dequantized by transformers)" if gguf_file else None,
        sampling_defaults=checkpoint_sampling(model_id, _own_sampling(folder, gguf_file)),
    )


def _own_sampling(folder: str, gguf_file: str | None) -> SamplingDefaults:
    """A folder's generation_config.json; a .gguf file's folder is not its checkpoint."""
    return NO_SAMPLING_DEFAULTS if gguf_file else sampling_defaults(read_generation_config(folder))


def _split_path(path: str) -> tuple[str, str | None]:
    """(folder, gguf file name or None)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"No config.json in model folder {path}")
        return path, None
    if path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        return folder, name
    raise ValueError(f"Not a model folder or a .gguf file: {path}")


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} was asked for but CUDA is not available")
    return device


def _limits(config: transformers.PretrainedConfig, options: TransformersOptions) -> tuple[int, int]:
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    context = int(context) if context else DEFAULT_MAX_TOTAL_TOKENS
    max_total = options.max_total_tokens or min(context, DEFAULT_MAX_TOTAL_TOKENS)
    if max_total > context:
        raise ValueError(
            f"max_total_tokens {max_total} exceeds the model's context window ({context})"
        )
    max_input = options.max_input_tokens or max_total - 1
    if max_input >= max_total:
        raise ValueError(
            f"max_input_tokens ({max_input}) must be < max_total_tokens ({max_total})"
        )
    return max_input, max_total


def _merge_ids(*values: Any) -> list[int]:
    """Union of token ids given as None / int / list, first-seen order."""
    merged: list[int] = []
    for value in values:
        ids = [] if value is None else [value] if isinstance(value, int) else list(value)
        merged.extend(int(i) for i in ids if int(i) not in merged)
    return merged
