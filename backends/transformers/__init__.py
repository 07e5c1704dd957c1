"""The transformers backend: Hugging Face `generate` on any model transformers loads, and
encoder embedding models (task embed: BERT, XLM-R) pooled as sentence-transformers does.

Importing this package is light (no torch); the factory imports the backend when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backends.base import Backend
    from backends.registry import BackendSpec


def create_transformers_backend(spec: BackendSpec) -> Backend:
    """A TransformersBackend for `spec` (model_id: a local folder, a .gguf file or "default")."""
    from backends.transformers.options import TransformersOptions

    try:
        options = TransformersOptions.from_mapping(spec.options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"model {spec.name!r}: {e}") from None
    if spec.task == "embed":  # an encoder (BERT, XLM-R) pooled into vectors
        from backends.transformers.embedding_backend import TransformersEmbeddingBackend

        return TransformersEmbeddingBackend(spec.model_id, options, served_name=spec.name)
    from backends.transformers.backend import TransformersBackend

    return TransformersBackend(spec.model_id, options, served_name=spec.name)
