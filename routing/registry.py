"""ModelRegistry: served names and aliases -> deployments (backends).

One deployment per model today; `pick()` is the seam where balancing across
deployments and fallbacks will go.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from backends.base import Backend
from routing.errors import ModelNotFound


@dataclass(frozen=True)
class Deployment:
    """One place a model is served from."""

    name: str
    backend: Backend


@dataclass(frozen=True)
class ModelEntry:
    """A served model: its canonical name, its aliases and where it runs."""

    name: str
    deployments: tuple[Deployment, ...]
    aliases: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))


class ModelRegistry:
    """Resolves a requested model name (canonical or alias) to a `ModelEntry`."""

    def __init__(self) -> None:
        self._entries: dict[str, ModelEntry] = {}
        self._names: dict[str, str] = {}  # any accepted name -> canonical name

    def add(self, name: str, backend: Backend, aliases: Iterable[str] = ()) -> ModelEntry:
        aliases = tuple(a for a in dict.fromkeys(aliases) if a != name)
        for taken in (name, *aliases):
            if taken in self._names:
                raise ValueError(
                    f"model name or alias {taken!r} is already used by {self._names[taken]!r}"
                )
        entry = ModelEntry(name=name, deployments=(Deployment(name, backend),), aliases=aliases)
        self._entries[name] = entry
        for taken in (name, *aliases):
            self._names[taken] = name
        return entry

    def resolve(self, requested: str) -> ModelEntry:
        canonical = self._names.get(requested)
        if canonical is None:
            raise ModelNotFound(requested)
        return self._entries[canonical]

    def pick(self, entry: ModelEntry) -> Deployment:
        """The deployment to send one request to."""
        return entry.deployments[0]

    def models(self) -> list[ModelEntry]:
        return list(self._entries.values())

    def backends(self) -> list[Backend]:
        """Every distinct backend, in registration order (for start/close/health)."""
        seen: dict[int, Backend] = {}
        for entry in self._entries.values():
            for dep in entry.deployments:
                seen.setdefault(id(dep.backend), dep.backend)
        return list(seen.values())

    def sole_model(self) -> ModelEntry | None:
        """The only served model, when there is exactly one (default for requests without one)."""
        return next(iter(self._entries.values())) if len(self._entries) == 1 else None

    def __len__(self) -> int:
        return len(self._entries)
