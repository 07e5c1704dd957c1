"""A small deterministic embedding backend for gateway tests (no model, no torch).

Tokens are whitespace-separated words, each word's id its CRC-32 modulo `vocab_size`; an
input's vector is drawn from a generator seeded by its ids (so equal inputs give equal
vectors, in any batch), unit length when `normalized`. It refuses as a real backend does
(backends/embeddings.py's checks: empty inputs, ids outside the vocabulary, inputs past
`max_input_tokens`, a `dimensions` it cannot give). `delay_s` holds each request; `fail`
makes it raise EmbeddingFailed, `down` a DeploymentError (routing falls back from it).
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from backends.base import BackendStats, DeploymentError, Health, ModelInfo, StepTiming
from backends.embeddings import (
    EmbeddingFailed,
    EmbeddingRequest,
    Embeddings,
    check_dimensions,
    input_ids,
    truncated,
)


def words(text: str, vocab_size: int) -> list[int]:
    return [zlib.crc32(word.encode()) % vocab_size for word in text.split()]


def vector_of(ids: list[int], size: int, normalized: bool) -> np.ndarray:
    values = np.random.default_rng(ids).standard_normal(size).astype(np.float32)
    return values / np.linalg.norm(values) if normalized else values * 3


@dataclass
class EchoEmbeddingBackend:
    task: ClassVar[str] = "embed"
    name: str = "echo-embed"
    size: int = 16
    normalized: bool = True
    vocab_size: int = 1000
    max_input_tokens: int = 64
    delay_s: float = 0.0
    fail: bool = False
    down: bool = False
    requests: list[EmbeddingRequest] = field(default_factory=list)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def health(self) -> Health:
        return Health(ready=True)

    def info(self) -> ModelInfo:
        return ModelInfo(name=self.name, max_input_tokens=self.max_input_tokens,
                         max_total_tokens=self.max_input_tokens + 1, backend="echo-embed",
                         extra={"task": "embed", "embedding_size": self.size})

    def stats(self) -> BackendStats:
        return BackendStats()

    def drain_step_timings(self) -> list[StepTiming]:
        return []

    def _ids(self, req: EmbeddingRequest) -> list[list[int]]:
        return input_ids(req.inputs, lambda text: words(text, self.vocab_size),
                         vocab_size=self.vocab_size, max_input_tokens=self.max_input_tokens,
                         truncate=req.truncate)

    def count_embedding_tokens(self, req: EmbeddingRequest) -> int:
        return sum(len(ids) for ids in self._ids(req))

    async def embed(self, req: EmbeddingRequest) -> Embeddings:
        check_dimensions(req.dimensions, self.size, self.normalized, self.name)
        ids = self._ids(req)
        self.requests.append(req)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.down:
            raise DeploymentError("the echo embedding backend is down")
        if self.fail:
            raise EmbeddingFailed("the echo embedding backend was told to fail")
        vectors = np.stack([vector_of(i, self.size, self.normalized) for i in ids])
        return Embeddings(truncated(vectors, req.dimensions), sum(len(i) for i in ids))
