"""A tied embedding read from the packed lm_head: GGUF files that tie token_embd to the
output keep one packed copy of the table instead of a packed lm_head plus a dense embedding."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class PackedEmbedding(nn.Module):
    def __init__(self, head: Callable[[], nn.Module], num_embeddings: int, dim: int) -> None:
        super().__init__()
        self._head = head  # the model's lm_head, looked up per call (it is built later)
        self.num_embeddings, self.embedding_dim = num_embeddings, dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat, head = ids.reshape(-1), self._head()
        rows = head.rows(flat) if hasattr(head, "rows") else head.weight[flat]  # dense fallback
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, packed in lm_head"
