"""Request bodies of /v1/chat/completions and /v1/completions, with OpenAI's names and defaults.

Strict types (no "1" for 1). Fields that would change what is generated but that
we do not implement (tools, logit_bias, n > 1, ...) are refused with a 400 instead
of being silently ignored; harmless ones (user, metadata, ...) are accepted.
Unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

MAX_STOPS = 4
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1
CHAT_ROLES = ("system", "user", "assistant", "developer")


def unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", message)


def invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


def checked_text(value: str) -> str:
    """Refuse strings that cannot be encoded (lone surrogates from JSON escapes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid("string contains invalid unicode (a lone surrogate)") from None
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool | None = None


class SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension; -1 or 0: off
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: list[int] | None = None  # vLLM extension
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)  # extension
    ignore_eos: bool = False  # vLLM extension
    logit_bias: dict[str, Any] | None = None
    user: str | None = None

    @field_validator("model", "user")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return None if value is None else checked_text(value)

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise unsupported("n > 1 is not supported yet")
        if value is not None and value < 1:
            raise invalid("n must be 1")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise invalid("stop must be a string or a list of strings")
        if len(items) > MAX_STOPS:
            raise invalid(f"at most {MAX_STOPS} stop sequences are allowed")
        return tuple(checked_text(s) for s in items if s)

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise invalid("token ids must be >= 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise unsupported("logit_bias is not supported yet")
        return value

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _text_part(part: Any, index: int) -> str:
    if not isinstance(part, dict):
        raise invalid(f"content[{index}] must be an object like {{'type': 'text', 'text': ...}}")
    kind = part.get("type")
    if kind != "text":
        raise unsupported(
            f"content[{index}] has type {kind!r}; only 'text' content parts are supported"
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise invalid(f"content[{index}].text must be a string")
    return checked_text(text)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: str
    content: Any
    name: str | None = None
    tool_calls: list[Any] | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return None if value is None else checked_text(value)

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        if value in ("tool", "function"):
            raise unsupported(f"role {value!r} is not supported yet (tools are not supported)")
        if value not in CHAT_ROLES:
            raise invalid(f"unknown role {value!r}; expected one of {', '.join(CHAT_ROLES)}")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str:
        """A string, or OpenAI's list of text parts (joined with newlines, as vLLM does)."""
        if isinstance(value, str):
            return checked_text(value)
        if isinstance(value, list) and value:
            return "\n".join(_text_part(part, i) for i, part in enumerate(value))
        if value is None:
            raise invalid("content is required")
        raise invalid("content must be a string or a non-empty list of text parts")

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise unsupported("tool_calls are not supported yet")
        return value

    def as_dict(self) -> dict[str, Any]:
        # OpenAI's "developer" is the newer "system"; chat templates only know the latter.
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True  # vLLM extension
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise unsupported("top_logprobs > 0 is not supported yet")
        return value

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise unsupported("tools and functions are not supported yet")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        if value not in (None, "none", "auto"):
            raise unsupported("tool_choice is not supported yet (tools are not supported)")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise unsupported(
                f"response_format type {value.get('type')!r} is not supported yet; only 'text'"
            )
        return value

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(m != "text" for m in value):
            raise unsupported("only the 'text' modality is supported")
        return value

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int]:
        """A string or token ids; a list of one of those (a batch of one) is unwrapped."""
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) > 1:
                raise unsupported("batched prompts (a list of prompts) are not supported yet")
            value = value[0]
        if isinstance(value, str):
            if not value:
                raise invalid("prompt must not be empty")
            return checked_text(value)
        if isinstance(value, list) and value and all(_is_token_id(t) for t in value):
            return value
        raise invalid("prompt must be a non-empty string or a non-empty list of token ids")

    @field_validator("logprobs")
    @classmethod
    def _chosen_logprob_only(cls, value: int | None) -> int | None:
        if value:
            raise unsupported("logprobs > 0 (top alternatives) is not supported yet; use 0")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        if value:
            raise unsupported("echo is not supported yet")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise unsupported("suffix is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise unsupported("best_of other than 1 is not supported yet")
        return value

    def token_limit(self) -> int | None:
        return self.max_tokens


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31
