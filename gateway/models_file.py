"""The models file (`--config-file`, YAML): models, their deployments, routing, API keys.

A model is either `model_id` (one deployment of `backend`, native by default, as before)
or `deployments:`, a list of places it is served from. A deployment names its `backend`
(native | remote | tgi | transformers), its `weight` (> 0, default 1) and `priority`
(default 0, lower first), an optional `name`; every other field (`model_id`, `base_url`,
`model`, `api_key_env`, timeouts, engine options, or an `options:` mapping) belongs to its
backend, whose factory checks it strictly when the gateway starts. A model's `defaults:`
(temperature, top_p, top_k, min_p, repetition_penalty) are what its requests get when they
omit them (gateway/sampling_defaults.py). A model's `task` is `generate` (the default) or
`embed` (served on /v1/embeddings only; not by the tgi backend). Mistakes fail at startup
as a `ConfigError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from auth.keys import KeyDeclaration
from backends.base import NO_SAMPLING_DEFAULTS, SamplingDefaults
from backends.embeddings import Task
from backends.registry import BackendSpec
from backends.transformers.options import shared_engine_flags
from gateway.memory_size import parse_memory
from gateway.sampling_defaults import SamplingDefaultsDeclaration, declared
from routing.policy import RoutingPolicy


class ConfigError(ValueError):
    """The models file is missing, not YAML, or declares something wrong."""


class DeploymentDeclaration(BaseModel):
    """One entry of a model's `deployments:`; unknown fields go to the backend's factory."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    backend: str | None = Field(None, min_length=1)  # default: Settings.backend
    name: str | None = Field(None, min_length=1)  # default: "<backend>-<index>"
    weight: float = Field(1.0, gt=0, allow_inf_nan=False, strict=True)
    priority: int = Field(0, strict=True)
    model_id: str | None = Field(None, min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)

    def backend_options(self) -> dict[str, Any]:
        extra = dict(self.model_extra or {})
        both = sorted(set(extra) & set(self.options))
        if both:
            raise ValueError(f"{both} given both directly and under `options`")
        return {**self.options, **extra}


class ModelDeclaration(BaseModel):
    """One entry of the models file's `models:` list."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    name: str = Field(min_length=1)
    model_id: str | None = Field(None, min_length=1)
    backend: str | None = None  # with model_id; default: Settings.backend
    aliases: list[str] = Field(default_factory=list)
    options: dict[str, Any] = Field(default_factory=dict)  # with model_id
    deployments: list[DeploymentDeclaration] | None = Field(None, min_length=1)
    # How tool calls are read from the output; default: judged from the chat template.
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = None
    # Sampling defaults of requests that omit them: over the flag's and the checkpoint's.
    defaults: SamplingDefaultsDeclaration | None = None
    task: Task = "generate"  # embed: an embedding model, served on /v1/embeddings only

    @model_validator(mode="after")
    def _one_way(self) -> ModelDeclaration:
        if self.model_id is not None and self.deployments is not None:
            raise ValueError("give `model_id` or `deployments`, not both")
        if self.model_id is None and self.deployments is None:
            raise ValueError("`model_id` or `deployments` is required")
        if self.deployments is not None and (self.backend is not None or self.options):
            raise ValueError("with `deployments`, `backend` and `options` go in each deployment")
        for i, deployment in enumerate(self.deployments or ()):
            try:
                deployment.backend_options()
            except ValueError as exc:
                raise ValueError(f"deployments[{i}]: {exc}") from None
        return self


class RoutingDeclaration(BaseModel):
    """The `routing:` section: cooldowns and health checks (routing/policy.py)."""

    model_config = ConfigDict(extra="forbid")

    cooldown_after_failures: int = Field(3, ge=1, strict=True)
    cooldown_seconds: float = Field(30.0, gt=0, allow_inf_nan=False)
    health_check_interval: float = Field(10.0, gt=0, allow_inf_nan=False)

    def policy(self) -> RoutingPolicy:
        return RoutingPolicy(**self.model_dump())


class ConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ModelDeclaration] = Field(min_length=1)
    routing: RoutingDeclaration = Field(default_factory=RoutingDeclaration)
    keys: list[KeyDeclaration] = Field(default_factory=list)  # hashed API keys


@dataclass(frozen=True)
class DeploymentPlan:
    """A deployment to build: its backend spec plus how routing treats it."""

    name: str
    spec: BackendSpec
    weight: float = 1.0
    priority: int = 0


@dataclass(frozen=True)
class ModelPlan:
    name: str
    aliases: tuple[str, ...]
    deployments: tuple[DeploymentPlan, ...]
    tool_call_parser: str | None = None  # gateway/openai/tools FORMATS; None: from the template
    sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS  # `defaults:` over the flag's
    task: Task = "generate"


def _location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def describe(exc: ValidationError) -> str:
    """One line per mistake, each naming the field: `models[0].weight: ...`."""
    lines = []
    for err in exc.errors():
        message = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"  {_location(tuple(err['loc']))}: {message.removeprefix('Value error, ')}")
    return "\n".join(lines)


def load_config_file(path: Path) -> ConfigFile:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the models file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"the models file {path} is not valid YAML: {exc}") from None
    try:
        return ConfigFile.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        raise ConfigError(f"invalid models file {path}:\n{describe(exc)}") from None


def model_plan(
    decl: ModelDeclaration, default_backend: str, engine_defaults: Mapping[str, Any],
    sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS,
) -> ModelPlan:
    """A declaration -> its deployments' specs. Engine flags are defaults for native ones;
    `sampling_defaults` (the flag's) for the model, under its own `defaults:`."""
    if decl.deployments is None:
        assert decl.model_id is not None
        backend = decl.backend or default_backend
        spec = _spec(decl, backend, decl.model_id, decl.options, engine_defaults)
        deployments = (DeploymentPlan(f"{backend}-0", spec),)
    else:
        deployments = tuple(
            _deployment(decl, i, d, default_backend, engine_defaults)
            for i, d in enumerate(decl.deployments))
    return ModelPlan(decl.name, tuple(decl.aliases), deployments, decl.tool_call_parser,
                     declared(decl.defaults).over(sampling_defaults), decl.task)


def _deployment(
    decl: ModelDeclaration, index: int, d: DeploymentDeclaration, default_backend: str,
    engine_defaults: Mapping[str, Any],
) -> DeploymentPlan:
    backend = d.backend or default_backend
    spec = _spec(decl, backend, d.model_id or "", d.backend_options(), engine_defaults)
    return DeploymentPlan(d.name or f"{backend}-{index}", spec, d.weight, d.priority)


def _spec(
    decl: ModelDeclaration, backend: str, model_id: str, options: Mapping[str, Any],
    engine_defaults: Mapping[str, Any],
) -> BackendSpec:
    defaults = (engine_defaults if backend == "native"
                else shared_engine_flags(engine_defaults) if backend == "transformers" else {})
    if backend == "native" and not model_id:
        raise ConfigError(f"model {decl.name!r}: a native deployment needs `model_id`")
    if decl.task == "embed" and backend == "tgi":
        raise ConfigError(f"model {decl.name!r}: task embed cannot run on the tgi backend "
                          "(native, transformers or remote can)")
    if backend == "native" and "kv_cache_memory" in options:
        options = {**options, "kv_cache_memory": _memory(decl.name, options["kv_cache_memory"])}
    return BackendSpec(name=decl.name, model_id=model_id, backend=backend,
                       aliases=tuple(decl.aliases), options={**defaults, **options},
                       task=decl.task)


def _memory(model: str, value: Any) -> float | None:
    """`kv_cache_memory` as the CLI flag takes it (8GiB, 0.9, bytes)."""
    try:
        return parse_memory(value)
    except ValueError as exc:
        raise ConfigError(f"model {model!r}: kv_cache_memory: {exc}") from exc
