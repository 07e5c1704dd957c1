"""The body of POST /v1/responses, with OpenAI's names and defaults.

Strict types and bad values are 400s naming the field, as on the chat route. Fields that
would change what is generated and that are not implemented (background runs, stored
prompts, conversations, logprobs, hosted tools) are refused with a 400; harmless ones
(include, service_tier, prompt_cache_key, ...) are accepted. Unknown fields are ignored.
`input` is read into items by items.py; the rest is checked here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.openai.messages import checked_text, invalid, unsupported

JSON = dict[str, Any]
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
TOOL_CHOICES = ("none", "auto", "required")
FORMATS = ("text", "json_object", "json_schema")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: Any = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: dict[str, str] | None = None
    store: bool | None = True
    stream: bool | None = False
    user: str | None = None
    reasoning: Any = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    # Refused when set: they would change what is generated, and are not implemented.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("model", "instructions", "previous_response_id", "user")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return None if value is None else checked_text(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, value: Any) -> list[JSON] | None:
        if value is None:
            return None
        if not isinstance(value, list):
            raise invalid("tools must be a list of function tools")
        for i, tool in enumerate(value):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise unsupported(f"tools[{i}] has type {kind!r}; only function tools "
                                  "({'type': 'function', 'name': ..., 'parameters': {...}}) "
                                  "are supported")
            if not isinstance(tool.get("strict", False), bool | None):
                raise invalid(f"tools[{i}].strict must be a boolean")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> str | JSON | None:
        if value is None or value in TOOL_CHOICES:
            return value
        if isinstance(value, dict) and value.get("type") == "function" and isinstance(
                value.get("name"), str):
            return {"type": "function", "name": checked_text(value["name"])}
        raise invalid("tool_choice must be 'none', 'auto', 'required' or "
                      "{'type': 'function', 'name': ...}")

    @field_validator("text", mode="before")
    @classmethod
    def _text_config(cls, value: Any) -> JSON | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise invalid("text must be an object like {'format': {'type': 'json_object'}}")
        fmt = value.get("format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in FORMATS):
            raise invalid("text.format must be an object whose type is one of "
                          f"{', '.join(FORMATS)}")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA:
            raise invalid(f"metadata has {len(value)} keys; at most {MAX_METADATA} are allowed")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY or len(text) > MAX_METADATA_VALUE:
                raise invalid(f"metadata keys may have at most {MAX_METADATA_KEY} characters "
                              f"and values {MAX_METADATA_VALUE}")
        return value

    @field_validator("reasoning", mode="before")
    @classmethod
    def _reasoning(cls, value: Any) -> JSON | None:
        if value is not None and not isinstance(value, dict):
            raise invalid("reasoning must be an object like {'effort': 'medium'}")
        return value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool | None) -> bool | None:
        if value:
            raise unsupported("background responses are not supported; stream the response "
                              "instead")
        return value

    @field_validator("conversation", "prompt")
    @classmethod
    def _no_objects(cls, value: Any) -> Any:
        if value is not None:
            raise unsupported("conversations and stored prompts are not supported; continue "
                              "a conversation with previous_response_id")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise unsupported("top_logprobs is not supported on /v1/responses; use "
                              "/v1/chat/completions for logprobs")
        return value

    def text_format(self) -> JSON:
        fmt = (self.text or {}).get("format")
        return dict(fmt) if fmt is not None else {"type": "text"}

    def stores(self) -> bool:
        return self.store is not False

    def streams(self) -> bool:
        return bool(self.stream)
