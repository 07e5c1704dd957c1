"""Settings: the one reader of flags (via the CLI) and `SWITCHYARD_*` environment variables.

Names follow TGI's launcher. Nothing here runs at import time; the YAML config
file is read when `model_specs()` is called.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    PositiveInt,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from auth.factory import AuthConfig
from auth.limits import LEASE_TTL_S
from auth.recent_keys import FAIL_OPEN_TTL_S
from backends.base import SamplingDefaults
from backends.embeddings import Task
from backends.registry import BackendSpec
from gateway.memory_size import parse_memory
from gateway.models_file import (
    ConfigError,
    ConfigFile,
    ModelDeclaration,
    ModelPlan,
    load_config_file,
    model_plan,
)
from gateway.sampling_defaults import SamplingDefaultsDeclaration, declared, from_json_text
from routing.policy import RoutingPolicy

__all__ = ["ConfigError", "ConfigFile", "ModelDeclaration", "ModelPlan", "Settings"]

_ENGINE_FIELDS = (
    "dtype", "device", "max_input_tokens", "max_total_tokens", "max_batch_size",
    "max_batch_prefill_tokens", "max_batch_total_tokens", "kv_cache_memory", "block_size",
    "num_threads", "max_concurrent_requests", "max_queued_requests", "max_queued_tokens",
    "queue_timeout", "request_timeout", "waiting_served_ratio", "max_waiting_tokens",
    "chunked_prefill", "prefix_caching", "compile", "compile_decode_step",
    "compile_prefill_step", "prepack_weights", "bf16_linear_kernel", "f32_linear_kernel",
    "greedy_head", "attention_kernels", "quantize", "quantized_kernels", "cache_dir",
)
DEFAULT_MAX_BODY_BYTES = 8 * 1024**2
@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (gateway/limits.py enforces it; /info reports it)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_messages: int = 2048
    max_stop_sequences: int = 4
    max_stop_length: int = 512
    max_output_tokens: int | None = None
    max_embedding_inputs: int = 2048  # inputs of one /v1/embeddings request (OpenAI's limit)

    def report(self) -> dict[str, int | None]:
        return {"max_request_body_bytes": self.max_body_bytes, "max_messages": self.max_messages,
                "max_stop_sequences": self.max_stop_sequences,
                "max_stop_length": self.max_stop_length,
                "max_output_tokens": self.max_output_tokens,
                "max_embedding_inputs": self.max_embedding_inputs}


_LIMITS = RequestLimits()


def _split_origins(value: str | None) -> list[str]:
    return [origin.strip() for origin in (value or "").split(",") if origin.strip()]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SWITCHYARD_", extra="forbid", protected_namespaces=(),
        populate_by_name=True, case_sensitive=False,
    )

    model_id: str = "default"
    served_model_name: str | None = None
    backend: str = "native"
    task: Task = "generate"  # the --model-id model's; a models file declares each model's
    config_file: Path | None = None
    hostname: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    log_format: Literal["text", "json"] = "text"  # json: one object per line (log_format.py)

    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = None
    quantize: Literal[
        "gptq", "awq", "eetq", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "gguf",
        "none",
    ] | None = None
    quantized_kernels: Literal["auto", "native", "gptqmodel"] | None = None
    device: str | None = None
    max_input_tokens: PositiveInt | None = None
    max_input_length: PositiveInt | None = Field(None, exclude=True)  # TGI's old name
    max_total_tokens: PositiveInt | None = None
    max_batch_size: PositiveInt | None = None
    max_batch_prefill_tokens: PositiveInt | None = None
    max_batch_total_tokens: PositiveInt | None = None
    block_size: PositiveInt | None = None
    num_threads: PositiveInt | None = None
    kv_cache_memory: float | None = Field(None, gt=0)
    max_concurrent_requests: PositiveInt | None = None
    max_queued_requests: int | None = Field(None, ge=0)
    max_queued_tokens: int | None = Field(None, ge=0)
    queue_timeout: float | None = Field(None, gt=0)  # seconds
    request_timeout: float | None = Field(None, gt=0)  # seconds
    waiting_served_ratio: float | None = Field(None, ge=0)
    max_waiting_tokens: int | None = Field(None, ge=0)
    chunked_prefill: bool | None = None
    prefix_caching: bool | None = None
    compile: bool | None = None
    compile_decode_step: bool | None = None
    compile_prefill_step: bool | None = None
    prepack_weights: bool | None = None
    bf16_linear_kernel: bool | None = None
    f32_linear_kernel: bool | None = None
    greedy_head: bool | None = None
    attention_kernels: bool | None = None
    # the native engine's startup cache; unset: ~/.cache/switchyard (backends/registry.py)
    cache_dir: str | None = None
    # read by the kernel builder from the process environment (cli.py exports it); unset: auto
    cpu_kernels: Literal["auto", "required", "avx512-vnni", "avx2", "off"] | None = None

    # Auth: an admin key, a Redis URL or keys in the config file turn API keys on.
    admin_key: SecretStr | None = None
    redis_url: str | None = None
    auth_fail_open: bool = False
    auth_lease_ttl: float = Field(LEASE_TTL_S, gt=0)  # seconds a crashed replica holds a slot
    auth_fail_open_ttl: float = Field(FAIL_OPEN_TTL_S, gt=0)  # failing open: keys this recent
    metrics_auth: Literal["open", "key", "admin"] = "open"
    # Seconds a stored /v1/responses answer is kept (in Redis with redis_url, else on disk).
    responses_ttl: float = Field(30 * 24 * 3600.0, gt=0)

    # Request limits (gateway/limits.py) and graceful shutdown (gateway/drain.py).
    max_request_body_bytes: PositiveInt = _LIMITS.max_body_bytes  # TGI: --payload-limit
    max_messages: PositiveInt = _LIMITS.max_messages  # OpenAI's own limit
    max_stop_sequences: int = Field(_LIMITS.max_stop_sequences, ge=0)  # OpenAI's and TGI's
    max_stop_length: PositiveInt = _LIMITS.max_stop_length  # characters of one stop string
    max_output_tokens: PositiveInt | None = None  # None: the model's --max-total-tokens alone
    max_embedding_inputs: PositiveInt = _LIMITS.max_embedding_inputs
    shutdown_timeout: float = Field(30.0, ge=0)
    playground: bool = True  # the chat page at /playground (gateway/playground/)
    # Web origins (https://app.example) allowed to call from a browser: CORS, and in open mode
    # the only foreign origins not refused (gateway/browser_guard.py). Comma-separated.
    cors_allow_origins: str | None = None
    # Every model's sampling defaults, under a models file's `defaults:` (a JSON object).
    sampling_defaults: Annotated[SamplingDefaultsDeclaration | None, NoDecode] = None

    @model_validator(mode="after")
    def _tgi_spellings(self) -> Settings:
        if self.max_input_tokens is None and self.max_input_length is not None:
            self.max_input_tokens = self.max_input_length
        return self

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _memory(cls, value: Any) -> float | None:
        return parse_memory(value)

    @field_validator("sampling_defaults", mode="before")
    @classmethod
    def _json(cls, value: Any) -> Any:
        return from_json_text(value)

    @field_validator("max_request_body_bytes", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        return value if value is None or isinstance(value, int) else int(parse_memory(value) or 0)

    def request_limits(self) -> RequestLimits:
        return RequestLimits(
            max_body_bytes=self.max_request_body_bytes, max_messages=self.max_messages,
            max_stop_sequences=self.max_stop_sequences, max_stop_length=self.max_stop_length,
            max_output_tokens=self.max_output_tokens,
            max_embedding_inputs=self.max_embedding_inputs,
        )

    @field_validator("cors_allow_origins")
    @classmethod
    def _origins(cls, value: str | None) -> str | None:
        for origin in _split_origins(value):
            parts = urlsplit(origin)
            if parts.scheme not in ("http", "https") or not parts.netloc or \
                    origin != f"{parts.scheme}://{parts.netloc}":
                raise ValueError(f"{origin!r} is not a web origin (scheme://host[:port], no "
                                 "path or trailing slash, e.g. https://app.example.com)")
        return value

    def cors_origins(self) -> frozenset[str]:
        return frozenset(_split_origins(self.cors_allow_origins))

    @field_validator("log_level", "log_format", "cpu_kernels", "task", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    def served_name(self) -> str:
        return self.served_model_name or self.model_id

    def engine_kwargs(self) -> dict[str, Any]:
        """EngineConfig keyword arguments for the flag-level model (only what was set)."""
        kwargs: dict[str, Any] = {"model": self.model_id, "served_model_name": self.served_name()}
        kwargs.update(self._engine_options())
        return kwargs

    def _engine_options(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in _ENGINE_FIELDS}
        return {name: value for name, value in values.items() if value is not None}

    def model_specs(self) -> list[BackendSpec]:
        """Every deployment's backend spec, in order (see `model_plans`)."""
        return [d.spec for plan in self.model_plans() for d in plan.deployments]

    def model_plans(self) -> list[ModelPlan]:
        """The models to serve: the config file's list, or the one model the flags name.

        Engine flags apply to every native deployment; a declaration's options override them.
        """
        if self.config_file is None:
            decl = ModelDeclaration(name=self.served_name(), model_id=self.model_id,
                                    task=self.task)
            return [model_plan(decl, self.backend, self._engine_options(), self.flag_sampling())]
        models = self.load_config_file().models
        return [model_plan(decl, self.backend, self._engine_options(), self.flag_sampling())
                for decl in models]

    def flag_sampling(self) -> SamplingDefaults:
        """--sampling-defaults: every model's, under its `defaults:` in the models file."""
        return declared(self.sampling_defaults)

    def routing_policy(self) -> RoutingPolicy:
        if self.config_file is None:
            return RoutingPolicy()
        return self.load_config_file().routing.policy()

    def load_config_file(self) -> ConfigFile:
        """The models file, parsed and checked (a `ConfigError` names what is wrong)."""
        if self.config_file is None:
            raise ConfigError("no models file (--config-file) was given")
        return load_config_file(self.config_file)

    def auth_config(self) -> AuthConfig:
        keys = tuple(self.load_config_file().keys) if self.config_file is not None else ()
        admin = self.admin_key.get_secret_value() if self.admin_key is not None else None
        return AuthConfig(
            admin_key=admin or None, redis_url=self.redis_url or None,
            fail_open=self.auth_fail_open, keys=keys, lease_ttl_s=self.auth_lease_ttl,
            fail_open_ttl_s=self.auth_fail_open_ttl,
        )
