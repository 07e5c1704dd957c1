"""Tiny random embedding models for the tests, written as their real counterparts are saved.

- A decoder embedder shaped like Qwen3-Embedding: a bare `Qwen3Model` written with
  save_pretrained (no `model.` prefix, no lm_head), the default model's tokenizer beside it,
  and optionally a sentence-transformers config in the older boolean format.
- Encoders (`BertModel`, `XLMRobertaModel`) with a WordPiece tokenizer, saved through
  sentence-transformers itself with a Pooling (and Normalize) module.

The references are transformers' own forward (decoders) and sentence-transformers' `encode`
(encoders).
"""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import numpy as np
import torch

DECODER = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 512}
ENCODER = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 64, "max_position_embeddings": 128}
# Inputs of different lengths (the longest spans several KV blocks and prefill chunks).
TEXTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "A brave little toaster set out across the country to find its master, meeting a "
    "lamp, a radio, an electric blanket and a vacuum cleaner on the way.",
    "Embeddings map text to vectors.",
]


def write_st_pooling(folder: Path, mode: str, normalize: bool, size: int) -> None:
    """A sentence-transformers config in the older format (boolean `pooling_mode_*`)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models."
                "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers."
                "models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": size, "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": mode == "max",
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_lasttoken": mode == "last",
    }))


def write_decoder_embedder(folder: Path, tokenizer_dir: Path, pooling: str | None = None,
                           normalize: bool = True, seed: int = 0) -> Path:
    from transformers import AutoConfig, Qwen3Model

    config = AutoConfig.for_model("qwen3", vocab_size=49152, bos_token_id=1, eos_token_id=2,
                                  **DECODER)
    torch.manual_seed(seed)
    model = Qwen3Model(config)
    with torch.no_grad():  # norms that are not all ones: a skipped final norm shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, folder / item.name)
    if pooling is not None:
        write_st_pooling(folder, pooling, normalize, DECODER["hidden_size"])
    return folder


def decoder_reference(folder: Path, texts: list[str], pooling: str = "last",
                      normalize: bool = True) -> np.ndarray:
    """transformers' own forward, one input at a time (no padding): the final hidden states
    pooled as asked."""
    from transformers import AutoTokenizer, Qwen3Model

    model = Qwen3Model.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = []
    for text in texts:
        ids = torch.tensor([tokenizer(text).input_ids])
        with torch.no_grad():
            states = model(ids).last_hidden_state[0]
        vector = {"last": states[-1], "cls": states[0], "mean": states.mean(0)}[pooling]
        out.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return torch.stack(out).numpy()


def write_encoder(folder: Path, kind: str, pooling: str, normalize: bool = True,
                  seed: int = 0) -> Path:
    """A tiny random BertModel / XLMRobertaModel saved by sentence-transformers with
    `pooling` ("cls" or "mean") and, when `normalize`, a Normalize module."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )
    from transformers import (
        BertConfig,
        BertModel,
        BertTokenizerFast,
        XLMRobertaConfig,
        XLMRobertaModel,
    )

    raw = folder / "raw"
    raw.mkdir(parents=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase,
             *(f"##{c}" for c in string.ascii_lowercase), *string.punctuation,
             "the", "a", "cat", "dog", "brave", "little", "toaster", "quick", "fox"]
    (raw / "vocab.txt").write_text("\n".join(vocab))
    BertTokenizerFast(vocab_file=str(raw / "vocab.txt")).save_pretrained(raw)
    torch.manual_seed(seed)
    if kind == "bert":
        BertModel(BertConfig(vocab_size=len(vocab), **ENCODER)).save_pretrained(raw)
    else:  # XLM-R counts positions from its padding id: the tokenizer's [PAD] is 0
        config = XLMRobertaConfig(vocab_size=len(vocab), pad_token_id=0, bos_token_id=2,
                                  eos_token_id=3, **{**ENCODER, "max_position_embeddings": 130})
        XLMRobertaModel(config).save_pretrained(raw)
    transformer = Transformer(str(raw))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling)]
    model = SentenceTransformer(modules=[*modules, Normalize()] if normalize else modules)
    saved = folder / "model"
    model.save(str(saved))
    return saved


def encoder_reference(folder: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)


def cosine_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    dots = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return 1 - dots
