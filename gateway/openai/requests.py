"""Request bodies of /v1/chat/completions and /v1/completions, with OpenAI's names and defaults.

Strict types (no "1" for 1), bad values are 400s naming the field. Fields that would
change what is generated but that we do not implement (echo, suffix, ...) are refused
with a 400 instead of being silently ignored; harmless ones (user, metadata, ...) are
accepted. Unknown fields are ignored, as vLLM does. Checks that involve two fields
are in `check()`, which the route calls after parsing.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from backends.base import StructuredOutput
from gateway.errors import bad_request
from gateway.openai import formats
from gateway.openai.messages import ChatMessage, checked_text, invalid, unsupported

MAX_STOPS = 4  # the default of --max-stop-sequences (gateway/limits.py checks it)
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
# Entries of logit_bias, and ids of stop_token_ids, one request may give (OpenAI documents no
# cap; every step applies them to each of the `n` choices, so they are bounded like `stop`).
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 1024
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1
_TOKEN_ID_MAX = 2**31
TOOL_CHOICES = ("none", "auto", "required")


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
    min_p: float | None = Field(None, ge=0, le=1)  # extension
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
    min_tokens: int | None = Field(None, ge=0)  # vLLM extension
    logit_bias: Any = Field(None, validate_default=True)  # -> ((token id, bias), ...)
    user: str | None = None
    # Output constraints, each validated into a StructuredOutput (or None).
    response_format: Any = None
    structured_outputs: Any = None  # vLLM extension, as are the guided_* below
    guided_json: Any = None
    guided_regex: Any = None
    guided_grammar: Any = None
    guided_choice: Any = None

    @field_validator("model", "user")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return None if value is None else checked_text(value)

    @field_validator("n")
    @classmethod
    def _choices(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_CHOICES:
            raise invalid(f"n must be between 1 and {MAX_CHOICES}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise invalid("stop must be a string or a list of strings")
        return tuple(checked_text(s) for s in items if s)

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(value) > MAX_STOP_TOKEN_IDS:
            raise invalid(f"stop_token_ids has {len(value)} ids; at most {MAX_STOP_TOKEN_IDS} "
                          "are allowed")
        if value is not None and any(not 0 <= t < _TOKEN_ID_MAX for t in value):
            raise invalid("token ids must be >= 0 and < 2**31")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> tuple[tuple[int, float], ...]:
        if value is None:
            return ()
        if not isinstance(value, dict):
            raise invalid("logit_bias must be an object mapping token ids to biases")
        if len(value) > MAX_LOGIT_BIAS:
            raise invalid(f"logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS} are "
                          "allowed (bias fewer tokens, e.g. only those to favour or ban)")
        return tuple(_bias(key, bias) for key, bias in value.items())

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, value: Any) -> StructuredOutput | None:
        return formats.response_format(value)

    @field_validator("structured_outputs", mode="before")
    @classmethod
    def _structured_outputs(cls, value: Any) -> StructuredOutput | None:
        return formats.structured_outputs(value)

    @field_validator("guided_json", "guided_regex", "guided_grammar", "guided_choice",
                     mode="before")
    @classmethod
    def _guided(cls, value: Any, info: ValidationInfo) -> StructuredOutput | None:
        return formats.guided(info.field_name.removeprefix("guided_"), value)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def choices(self) -> int:
        return self.n or 1

    def token_limit(self) -> int | None:
        return self.max_tokens

    def structured(self) -> StructuredOutput | None:
        """The one output constraint asked for, if any (`check` refuses several)."""
        return next((c for _, c in self._constraints()), None)

    def _constraints(self) -> list[tuple[str, StructuredOutput]]:
        fields = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                  "guided_grammar", "guided_choice")
        return [(f, getattr(self, f)) for f in fields if getattr(self, f) is not None]

    def check(self) -> None:
        """Checks across fields: a 400 naming the field at fault."""
        limit = self.token_limit()
        if self.min_tokens and limit is not None and self.min_tokens > limit:
            raise bad_request(f"min_tokens ({self.min_tokens}) must not exceed the token "
                              f"limit ({limit})", "min_tokens", "invalid_value")
        constraints = self._constraints()
        if len(constraints) > 1:
            names = " and ".join(f for f, _ in constraints)
            raise bad_request(f"{names} both constrain the output; give only one",
                              constraints[1][0], "invalid_value")


def _bias(key: Any, bias: Any) -> tuple[int, float]:
    if not (isinstance(key, str) and key.isdecimal() and len(key) <= 10
            and int(key) < _TOKEN_ID_MAX):
        raise invalid(f"logit_bias key {key!r} is not a token id (a string of digits, as "
                      "in {'50256': -100})")
    if isinstance(bias, bool) or not isinstance(bias, int | float) or not (
            math.isfinite(bias) and -100 <= bias <= 100):
        raise invalid(f"logit_bias[{key!r}] must be a number from -100 to 100")
    return int(key), float(bias)


def _tool_choice(value: Any) -> str | dict[str, Any] | None:
    if value is None or value in TOOL_CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return {"type": "function", "function": {"name": checked_text(function["name"])}}
    raise invalid("tool_choice must be 'none', 'auto', 'required' or "
                  "{'type': 'function', 'function': {'name': ...}}")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM extension
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    # A thinking model's reasoning in the answer (OpenRouter / vLLM); it is generated anyway.
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: extra template variables

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> str | dict[str, Any] | None:
        return _tool_choice(value)

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, value: Any) -> Any:
        if value:
            raise unsupported("functions and function_call (deprecated by OpenAI) are not "
                              "supported; use tools and tool_choice")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(m != "text" for m in value):
            raise unsupported("only the 'text' modality is supported")
        return value

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens

    def top_logprobs_count(self) -> int:
        return self.top_logprobs or 0

    def forces_tools(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs",
                              "invalid_value")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise bad_request("tool_choice other than 'none' or 'auto' needs tools",
                              "tool_choice", "invalid_value")
        if self.forces_tools() and self.structured() is not None:
            raise bad_request("a forced tool call (tool_choice 'required' or a named "
                              "function) cannot be combined with response_format",
                              "response_format", "invalid_value")


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

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

    def candidates(self) -> int:
        """Choices generated: `best_of` (the best `n` of them are returned), else `n`."""
        return self.best_of or self.choices()

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of < self.choices():
            raise bad_request(f"best_of ({self.best_of}) must be at least n "
                              f"({self.choices()})", "best_of", "invalid_value")
        if self.stream and self.candidates() > self.choices():
            raise bad_request("best_of greater than n cannot be streamed", "best_of",
                              "invalid_value")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _TOKEN_ID_MAX
