"""A deployment's options for an HTTP upstream, validated strictly: a bad field fails startup
naming it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from backends.remote.limits import MIB, ResponseLimits

DEFAULT_MAX_TOTAL_TOKENS = 4096


class UpstreamOptions(BaseModel):
    """Fields every HTTP backend takes (`model`: the upstream's name, default the served one)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    base_url: str
    model: str | None = None
    api_key_env: str | None = None
    connect_timeout: float = Field(5.0, gt=0)
    read_timeout: float = Field(120.0, gt=0)  # the longest wait between two bytes
    request_timeout: float = Field(900.0, gt=0)  # the longest a whole request may take
    max_connections: int = Field(64, ge=1)  # open connections to this upstream at most
    max_response_bytes: int = Field(16 * MIB, ge=1024)  # a whole (non-streamed) answer
    max_sse_line_bytes: int = Field(MIB, ge=1024)  # one line of an event stream
    max_sse_event_bytes: int = Field(4 * MIB, ge=1024)  # one event (its data lines joined)
    tokenizer: str | None = None  # a Hugging Face tokenizer folder or a .gguf file
    # vLLM's name is accepted too; unset: the upstream's, read from it (else 4096).
    max_total_tokens: int | None = Field(
        None, ge=2, validation_alias=AliasChoices("max_total_tokens", "max_model_len"))

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        parts = urlsplit(value)
        if parts.username is not None or parts.password is not None:
            raise ValueError(
                "must not carry credentials (user:pass@): URLs end up in logs and answers. "
                "Put the upstream's key in an environment variable and name it with "
                "`api_key_env` (sent as `Authorization: Bearer`)")
        if not parts.hostname:
            raise ValueError("names no host")
        return value.rstrip("/")

    def limits(self) -> ResponseLimits:
        return ResponseLimits(self.max_response_bytes, self.max_sse_line_bytes,
                              self.max_sse_event_bytes)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = os.path.expanduser(value)
        folder_ok = os.path.isfile(os.path.join(path, "tokenizer.json"))
        if not (folder_ok or (path.endswith(".gguf") and os.path.isfile(path))):
            raise ValueError(f"{value!r} is neither a folder with tokenizer.json nor a .gguf file")
        return path

    @field_validator("api_key_env")
    @classmethod
    def _key_env(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("must name an environment variable")
        return value


class RemoteOptions(UpstreamOptions):
    """An OpenAI-compatible upstream; `base_url` includes the API prefix (`.../v1`)."""


OptionsT = TypeVar("OptionsT", bound=UpstreamOptions)
ALIASES = frozenset({"max_model_len"})  # other names of fields


def parse_options(
    cls: type[OptionsT], backend: str, model: str, options: Mapping[str, Any],
) -> OptionsT:
    """`options` as `cls`, or a ValueError naming the model, the backend and the bad field."""
    unknown = sorted(set(options) - set(cls.model_fields) - ALIASES)
    if unknown:
        raise ValueError(
            f"model {model!r}: unknown {backend} backend option(s) {unknown}; "
            f"known: {sorted(cls.model_fields)}"
        )
    try:
        return cls.model_validate(dict(options))
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or "options"
        raise ValueError(
            f"model {model!r}: {backend} backend option {field!r}: {first['msg']}"
        ) from None


def api_key(options: UpstreamOptions, model: str) -> str | None:
    """The upstream key from the environment variable the options name (read now)."""
    if options.api_key_env is None:
        return None
    value = os.environ.get(options.api_key_env)
    if not value:
        raise ValueError(
            f"model {model!r}: api_key_env names {options.api_key_env!r}, which is not set"
        )
    return value
