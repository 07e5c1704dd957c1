"""Builds a Backend from a declarative spec, importing heavy backends lazily.

This is the only module outside `backends/` that leads to torch, and only when
`create_backend()` is called for a backend that needs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from backends.base import Backend
from backends.embeddings import Task
from backends.transformers import create_transformers_backend


@dataclass(frozen=True)
class BackendSpec:
    """One served model: its name, aliases, which backend runs it and that backend's options."""

    name: str
    model_id: str
    backend: str = "native"
    aliases: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    task: Task = "generate"  # embed: /v1/embeddings only (backends/embeddings.py)


def _native(spec: BackendSpec) -> Backend:
    from backends.machine.cache_dir import DEFAULT_CACHE_DIR
    from backends.native.backend import NativeBackend
    from backends.native.config import EngineConfig

    known = {f.name for f in dataclasses.fields(EngineConfig)} - {
        "model", "served_model_name", "task"}
    unknown = sorted(set(spec.options) - known)
    if unknown:
        raise ValueError(
            f"model {spec.name!r}: unknown native backend option(s) {unknown}; "
            f"known: {sorted(known)}"
        )
    # served models cache their startup by default; engines built directly (tests) do not
    options = {"cache_dir": DEFAULT_CACHE_DIR, **spec.options}
    config = EngineConfig(model=spec.model_id, served_model_name=spec.name, task=spec.task,
                          **options)
    if spec.task == "embed":
        from backends.native.embedding_backend import NativeEmbeddingBackend

        return NativeEmbeddingBackend(config)
    return NativeBackend(config)


def _remote(spec: BackendSpec) -> Backend:
    from backends.remote.backend import RemoteBackend
    from backends.remote.options import RemoteOptions, parse_options

    return RemoteBackend(spec.name, parse_options(RemoteOptions, "remote", spec.name,
                                                  spec.options))


def _tgi(spec: BackendSpec) -> Backend:
    if spec.task != "generate":
        raise ValueError(f"model {spec.name!r}: the tgi backend serves text generation only "
                         f"(task {spec.task!r}); use native, transformers or remote")
    from backends.remote.options import parse_options
    from backends.tgi.backend import TGIBackend
    from backends.tgi.options import TGIOptions

    return TGIBackend(spec.name, parse_options(TGIOptions, "tgi", spec.name, spec.options))


_FACTORIES: dict[str, Callable[[BackendSpec], Backend]] = {
    "native": _native,
    "transformers": create_transformers_backend,
    "remote": _remote,
    "tgi": _tgi,
}


def available_backends() -> list[str]:
    return sorted(_FACTORIES)


def create_backend(spec: BackendSpec) -> Backend:
    """A new, not yet started backend for `spec`."""
    factory = _FACTORIES.get(spec.backend)
    if factory is None:
        raise ValueError(
            f"model {spec.name!r}: backend {spec.backend!r} is not available; "
            f"choose one of {available_backends()}"
        )
    return factory(spec)

