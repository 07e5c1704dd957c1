"""Chat messages of a request: roles, text parts, tool calls and tool results.

An assistant message may carry `tool_calls` (its content may then be null); a `tool`
message answers one of them by `tool_call_id`. Messages reach the backend (after the
tool plan has prepared them for the chat template) as plain dicts.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


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


def _tool_call(call: Any, index: int) -> dict[str, Any]:
    """One assistant tool call: {"id", "type": "function", "function": {"name", "arguments"}}."""
    where = f"tool_calls[{index}]"
    if not isinstance(call, dict):
        raise invalid(f"{where} must be an object")
    if call.get("type", "function") != "function":
        raise invalid(f"{where}.type must be 'function'")
    function = call.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{where}.function must be an object with 'name' and 'arguments'")
    name, arguments = function.get("name"), function.get("arguments", "")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.function.name must be a non-empty string")
    if not isinstance(arguments, str):
        raise invalid(f"{where}.function.arguments must be a string (JSON text)")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise invalid(f"{where}.id must be a string")
    out: dict[str, Any] = {"type": "function", "function": {
        "name": checked_text(name), "arguments": checked_text(arguments)}}
    if call_id is not None:
        out["id"] = checked_text(call_id)
    return out


class ChatMessage(BaseModel):
    # Field order matters: later validators look at the role and tool calls already checked.
    model_config = ConfigDict(strict=True, extra="ignore")

    role: str
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = Field(None, validate_default=True)
    content: Any = Field(None, validate_default=True)
    # An earlier answer's reasoning (a thinking model's template may render it back).
    reasoning_content: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return None if value is None else checked_text(value)

    @field_validator("reasoning_content")
    @classmethod
    def _reasoning(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("role") != "assistant":
            raise invalid("only assistant messages may have reasoning_content")
        return None if value is None else checked_text(value)

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        if value == "function":
            raise unsupported("role 'function' (deprecated by OpenAI) is not supported; use "
                              "'tool' messages with tool_call_id")
        if value not in CHAT_ROLES:
            raise invalid(f"unknown role {value!r}; expected one of {', '.join(CHAT_ROLES)}")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, value: list[Any] | None, info: ValidationInfo,
                    ) -> list[dict[str, Any]] | None:
        if value is None:
            return None
        if value and info.data.get("role", "assistant") != "assistant":
            raise invalid("only assistant messages may have tool_calls")
        return [_tool_call(call, i) for i, call in enumerate(value)]

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.data.get("role") == "tool":
            raise invalid("a tool message needs tool_call_id (the id of the call it answers)")
        return None if value is None else checked_text(value)

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any, info: ValidationInfo) -> str | None:
        """A string, or OpenAI's list of text parts (joined with newlines, as vLLM does)."""
        if isinstance(value, str):
            return checked_text(value)
        if isinstance(value, list) and value:
            return "\n".join(_text_part(part, i) for i, part in enumerate(value))
        if value is None:
            if info.data.get("role") == "assistant" and info.data.get("tool_calls"):
                return None
            raise invalid("content is required (it may be null only in an assistant "
                          "message with tool_calls)")
        raise invalid("content must be a string or a non-empty list of text parts")

    def as_dict(self) -> dict[str, Any]:
        # OpenAI's "developer" is the newer "system"; chat templates only know the latter.
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role}
        if self.content is not None:  # templates expect no key rather than None (HF's way)
            message["content"] = self.content
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message
