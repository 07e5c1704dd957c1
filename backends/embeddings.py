"""Embeddings: what a backend that serves `/v1/embeddings` takes and returns (no torch).

A model has a task: `generate` (chat, completions, TGI's routes) or `embed` (embeddings
only). A backend of an embedding model implements `EmbeddingBackend`: `embed()` turns every
input of a request into one float32 vector, in order, and reports the prompt tokens it read.
The checks every local backend runs are here too, so that they refuse alike: an empty input,
ids outside the vocabulary or an input past the model's length (a 400 naming the input's
index), and a `dimensions` the model cannot give.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from backends.base import RequestError

Task = Literal["generate", "embed"]
TASKS: tuple[Task, ...] = ("generate", "embed")
# A text, or its token ids (given by the client as they are: no special tokens added).
EmbeddingInput = str | tuple[int, ...]


@dataclass(frozen=True)
class EmbeddingRequest:
    request_id: str
    inputs: tuple[EmbeddingInput, ...]
    # Keep the first `dimensions` values of each vector and renormalise (None: all of them).
    dimensions: int | None = None
    user: str | None = None  # the client's end-user id (passed to an upstream)
    # Cut an input longer than the model takes to its first tokens rather than refuse it
    # (Ollama's `truncate`); a remote upstream applies its own rule.
    truncate: bool = False


@dataclass(frozen=True)
class Embeddings:
    vectors: np.ndarray  # float32 [len(inputs), size]: row i is input i's vector
    prompt_tokens: int  # every input's tokens, summed


class EmbeddingFailed(Exception):
    """The model failed while computing a request's vectors (a server error: 500)."""


@runtime_checkable
class EmbeddingBackend(Protocol):
    async def embed(self, req: EmbeddingRequest) -> Embeddings: ...

    def count_embedding_tokens(self, req: EmbeddingRequest) -> int:
        """The tokens `embed` would read (for admission against the key's token limits)."""
        ...


def task_of(backend: Any, default: Task = "generate") -> Task:
    """The task a backend was built for (its `task` attribute), else `default`."""
    task = getattr(backend, "task", None)
    return task if task in TASKS else default


def check_dimensions(dimensions: int | None, size: int, normalized: bool, model: str) -> None:
    """RequestError (400, `dimensions`) when the model cannot give `dimensions` values: more
    than it has, or any from a model that does not normalise its vectors (shortening is
    defined on unit vectors: cut, then renormalise)."""
    if dimensions is None:
        return
    if dimensions > size:
        raise RequestError(
            f"dimensions is {dimensions}, but the model `{model}` gives vectors of {size} "
            f"values; ask for at most {size}", param="dimensions", code="invalid_value")
    if not normalized:
        raise RequestError(
            f"the model `{model}` does not normalise its vectors (its sentence-transformers "
            "config has no Normalize), so `dimensions` cannot shorten them; leave it out",
            param="dimensions", code="invalid_value")


def truncated(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first `dimensions` values of each row, renormalised to unit length (as OpenAI's
    text-embedding-3 models shorten theirs)."""
    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    cut = vectors[:, :dimensions].astype(np.float32)
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return cut / np.maximum(norms, 1e-12)


def input_ids(
    inputs: Sequence[EmbeddingInput], encode: Callable[[str], list[int]], *, vocab_size: int,
    max_input_tokens: int, truncate: bool = False,
) -> list[list[int]]:
    """Each input's token ids (texts through `encode`), or a RequestError naming the first
    input that cannot run: empty, ids outside the vocabulary, longer than the model takes
    (with `truncate`, such an input is cut to its first `max_input_tokens` tokens instead)."""
    out: list[list[int]] = []
    for index, item in enumerate(inputs):
        ids = encode(item) if isinstance(item, str) else list(item)
        where = f"input[{index}]"
        if not ids:
            raise RequestError(f"{where} has no tokens; every input needs at least one",
                               param=where, code="invalid_value")
        if any(not 0 <= t < vocab_size for t in ids):
            raise RequestError(f"{where} has token ids outside the vocabulary (0 to "
                               f"{vocab_size - 1})", param=where, code="invalid_value")
        if len(ids) > max_input_tokens and truncate:
            ids = ids[:max_input_tokens]
        elif len(ids) > max_input_tokens:
            raise RequestError(
                f"{where} has {len(ids)} tokens, more than this model's maximum input of "
                f"{max_input_tokens} tokens; shorten or split it", param=where,
                code="context_length_exceeded")
        out.append(ids)
    return out
