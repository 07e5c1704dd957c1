"""Encoder embedding models (BERT, XLM-R and kin) through transformers: loading, and one
request's inputs run in padded batches and pooled as the model's sentence-transformers config
says (backends/pooling.py; CLS and normalised without one).

The inputs are sorted by length and run `batch_size` at a time, right-padded with the
tokenizer's pad id under an attention mask, so a padded position changes no vector: CLS is
position 0, mean averages the unmasked positions, last takes each input's own last position.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import transformers
from transformers import AutoModel, AutoTokenizer

from backends.default_model import resolve_model_path
from backends.machine.cpu_dtype import choose_dtype
from backends.pooling import ENCODER_DEFAULT, Pooling, read_pooling
from backends.transformers.options import TransformersOptions

log = logging.getLogger(__name__)

BATCH_SIZE = 32  # inputs per forward pass
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Architectures that number positions from their padding id + 1 (RoBERTa's scheme).
_PADDED_POSITIONS = ("roberta", "xlm-roberta", "camembert")


@dataclass(frozen=True)
class LoadedEncoder:
    path: str
    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str
    pooling: Pooling
    size: int  # the vectors' length (the hidden size)
    vocab_size: int
    max_input_tokens: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids with the tokenizer's special tokens ([CLS] ... [SEP]), as
        sentence-transformers tokenizes."""
        return list(self.tokenizer(text).input_ids)


def load_encoder(model_id: str, options: TransformersOptions) -> LoadedEncoder:
    path = resolve_model_path(model_id)
    pooling = read_pooling(path, ENCODER_DEFAULT)  # refused here, before the weights
    device = torch.device(options.device)
    choice = choose_dtype(_DTYPES.get(options.dtype), device)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    log.info("loading %s with transformers as an embedding model (%s on %s, %s pooling)",
             path, choice.name, device, pooling.mode)
    model = AutoModel.from_pretrained(path, dtype=choice.dtype, local_files_only=True)
    model = model.to(device).eval()
    config = model.config
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return LoadedEncoder(
        path=path, model=model, tokenizer=tokenizer, device=device, dtype=choice.dtype,
        dtype_reason=choice.reason, pooling=pooling, size=int(config.hidden_size),
        vocab_size=model.get_input_embeddings().num_embeddings,
        max_input_tokens=_max_input_tokens(config, options), pad_id=int(pad_id))


def _max_input_tokens(config: transformers.PretrainedConfig,
                      options: TransformersOptions) -> int:
    """What the position table holds (RoBERTa's starts past its padding id), or less when
    the options say so."""
    positions = int(getattr(config, "max_position_embeddings", 512))
    if getattr(config, "model_type", "") in _PADDED_POSITIONS:
        positions -= int(getattr(config, "pad_token_id", 1) or 0) + 1
    limits = [positions, options.max_input_tokens or positions]
    return min(limits)


@torch.inference_mode()
def embed_batches(loaded: LoadedEncoder, prompts: list[list[int]],
                  batch_size: int = BATCH_SIZE) -> np.ndarray:
    """float32 [len(prompts), size]: each prompt's pooled (and normalised) vector."""
    out = np.empty((len(prompts), loaded.size), dtype=np.float32)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        out[chunk] = _pooled(loaded, [prompts[i] for i in chunk]).cpu().numpy()
    return out


def _pooled(loaded: LoadedEncoder, prompts: list[list[int]]) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), loaded.pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
        mask[row, : len(prompt)] = 1
    ids, mask = ids.to(loaded.device), mask.to(loaded.device)
    states = loaded.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    mode = loaded.pooling.mode
    if mode == "cls":
        vectors = states[:, 0]
    elif mode == "mean":
        weights = mask.unsqueeze(-1).float()
        vectors = (states * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    else:
        vectors = states[torch.arange(len(prompts)), mask.sum(1) - 1]
    return torch.nn.functional.normalize(vectors, dim=1) if loaded.pooling.normalize else vectors
