"""ModelRegistry: served names and aliases -> `ModelEntry` (its deployments and router)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from backends.base import NO_SAMPLING_DEFAULTS, Backend, SamplingDefaults
from backends.embeddings import Task
from routing.deployment import Deployment
from routing.errors import ModelNotFound
from routing.policy import RoutingPolicy
from routing.router import ModelRouter


@dataclass(frozen=True)
class ModelEntry:
    """A served model: its canonical name, its aliases and the router over its deployments."""

    name: str
    router: ModelRouter
    aliases: tuple[str, ...] = ()
    tool_call_parser: str | None = None  # the models file's override; None: from the template
    # Configured (models file over flag); the checkpoint's own come from its backend's info.
    sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def deployments(self) -> tuple[Deployment, ...]:
        return self.router.deployments

    @property
    def task(self) -> Task:
        """generate (chat, completions, TGI's routes) or embed (/v1/embeddings)."""
        return self.router.task


class ModelRegistry:
    """Resolves a requested model name (canonical or alias) to a `ModelEntry`."""

    def __init__(self, policy: RoutingPolicy | None = None) -> None:
        self.policy = policy or RoutingPolicy()
        self._entries: dict[str, ModelEntry] = {}
        self._names: dict[str, str] = {}  # any accepted name -> canonical name

    def add(self, name: str, backend: Backend, aliases: Iterable[str] = ()) -> ModelEntry:
        """A model served by one backend (its one deployment is named after the model)."""
        return self.add_model(name, [Deployment(name, backend)], aliases)

    def add_model(
        self, name: str, deployments: Sequence[Deployment], aliases: Iterable[str] = (),
        tool_call_parser: str | None = None,
        sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS, task: Task = "generate",
    ) -> ModelEntry:
        aliases = tuple(a for a in dict.fromkeys(aliases) if a != name)
        for taken in (name, *aliases):
            if taken in self._names:
                raise ValueError(
                    f"model name or alias {taken!r} is already used by {self._names[taken]!r}"
                )
        router = ModelRouter(name, deployments, self.policy, task=task)
        entry = ModelEntry(name, router, aliases, tool_call_parser, sampling_defaults)
        self._entries[name] = entry
        for taken in (name, *aliases):
            self._names[taken] = name
        return entry

    def resolve(self, requested: str) -> ModelEntry:
        canonical = self._names.get(requested)
        if canonical is None:
            raise ModelNotFound(requested)
        return self._entries[canonical]

    def models(self) -> list[ModelEntry]:
        return list(self._entries.values())

    def deployments(self) -> Iterator[tuple[str, Deployment]]:
        """(model name, deployment) for every deployment of every model."""
        for entry in self._entries.values():
            for deployment in entry.deployments:
                yield entry.name, deployment

    def backends(self) -> list[Backend]:
        """Every distinct backend, in registration order (for start/close)."""
        seen: dict[int, Backend] = {}
        for _, deployment in self.deployments():
            seen.setdefault(id(deployment.backend), deployment.backend)
        return list(seen.values())

    def backend_started(self, backend: Backend) -> None:
        """A backend finished start(): its deployments go (back) into rotation."""
        for _, deployment in self.deployments():
            if deployment.backend is backend:
                deployment.recovered()

    def sole_model(self) -> ModelEntry | None:
        """The only served model, when there is exactly one (default for requests without one)."""
        return next(iter(self._entries.values())) if len(self._entries) == 1 else None

    def __len__(self) -> int:
        return len(self._entries)
