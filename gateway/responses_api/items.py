"""The items of a conversation: messages, function calls, their outputs, and reasoning.

`parse_input` reads a request's `input` (a string, or a list of items in OpenAI's shapes)
into typed items, every mistake a 400 naming the item (`input[2].content[0].type`). Items
are stored in their canonical JSON (`as_json`, each with an id), which `parse_item` reads
back: a stored conversation and a client's list of items go through the same parser.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from gateway.errors import OpenAIError, bad_request
from gateway.openai.messages import checked_text

JSON = dict[str, Any]
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
STATUSES = ("in_progress", "completed", "incomplete")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


@dataclass(frozen=True)
class MessageItem:
    id: str
    role: str
    texts: tuple[str, ...]
    status: str = "completed"

    def as_json(self) -> JSON:
        if self.role == "assistant":
            content = [{"type": "output_text", "text": t, "annotations": [], "logprobs": []}
                       for t in self.texts]
        else:
            content = [{"type": "input_text", "text": t} for t in self.texts]
        return {"id": self.id, "type": "message", "role": self.role, "status": self.status,
                "content": content}


@dataclass(frozen=True)
class FunctionCallItem:
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"

    def as_json(self) -> JSON:
        return {"id": self.id, "type": "function_call", "status": self.status,
                "call_id": self.call_id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class FunctionOutputItem:
    id: str
    call_id: str
    output: str
    status: str = "completed"

    def as_json(self) -> JSON:
        return {"id": self.id, "type": "function_call_output", "status": self.status,
                "call_id": self.call_id, "output": self.output}


@dataclass(frozen=True)
class ReasoningItem:
    id: str
    texts: tuple[str, ...]  # the reasoning itself (`content`)
    summary: tuple[str, ...] = ()

    def as_json(self) -> JSON:
        return {"id": self.id, "type": "reasoning",
                "summary": [{"type": "summary_text", "text": s} for s in self.summary],
                "content": [{"type": "reasoning_text", "text": t} for t in self.texts]}


Item = MessageItem | FunctionCallItem | FunctionOutputItem | ReasoningItem


def parse_input(value: str | list[Any] | None) -> list[Item]:
    """A request's `input`: a string is one user message."""
    if value is None:
        return []
    if isinstance(value, str):
        return [MessageItem(new_id("msg"), "user", (checked_text(value),))]
    return [parse_item(item, f"input[{i}]") for i, item in enumerate(value)]


def parse_item(item: Any, where: str) -> Item:
    if not isinstance(item, dict):
        raise _invalid(f"{where} must be an object, such as {{'role': 'user', 'content': "
                       "'...'}", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        return _message(item, where)
    if kind == "function_call":
        return FunctionCallItem(
            _id(item, where, "fc"), _text(item, "call_id", where), _text(item, "name", where),
            _text(item, "arguments", where, empty=True), _status(item, where))
    if kind == "function_call_output":
        return FunctionOutputItem(_id(item, where, "fco"), _text(item, "call_id", where),
                                  _output(item.get("output"), f"{where}.output"))
    if kind == "reasoning":
        return ReasoningItem(_id(item, where, "rs"), _texts(item, "content", "reasoning_text",
                                                            where),
                             _texts(item, "summary", "summary_text", where))
    if kind == "item_reference":
        raise bad_request(f"{where}: item_reference is not supported; send the item itself, or "
                          "continue a stored conversation with previous_response_id",
                          f"{where}.type", "unsupported_value")
    raise bad_request(f"{where}.type {kind!r} is not supported; expected one of "
                      f"{', '.join(ITEM_TYPES)}", f"{where}.type", "invalid_value")


def _invalid(message: str, param: str) -> OpenAIError:
    return bad_request(message, param, "invalid_value")


def _id(item: JSON, where: str, prefix: str) -> str:
    value = item.get("id")
    if value is None:
        return new_id(prefix)
    if not isinstance(value, str) or not value:
        raise _invalid(f"{where}.id must be a non-empty string", f"{where}.id")
    return checked_text(value)


def _text(item: JSON, key: str, where: str, *, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not (value or empty):
        what = "a string" if empty else "a non-empty string"
        raise _invalid(f"{where}.{key} must be {what}", f"{where}.{key}")
    return checked_text(value)


def _status(item: JSON, where: str) -> str:
    value = item.get("status")
    if value is None:
        return "completed"
    if value not in STATUSES:
        raise _invalid(f"{where}.status must be one of {', '.join(STATUSES)}", f"{where}.status")
    return str(value)


def _message(item: JSON, where: str) -> MessageItem:
    role = item.get("role")
    if role not in ROLES:
        raise _invalid(f"{where}.role must be one of {', '.join(ROLES)} (got {role!r})",
                       f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        texts: tuple[str, ...] = (checked_text(content),)
    elif isinstance(content, list) and content:
        texts = tuple(_part(part, f"{where}.content[{j}]") for j, part in enumerate(content))
    else:
        raise _invalid(f"{where}.content must be a string or a non-empty list of "
                       "input_text / output_text parts", f"{where}.content")
    return MessageItem(_id(item, where, "msg"), str(role), texts, _status(item, where))


def _part(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in TEXT_PARTS:
        raise bad_request(f"{where}.type {kind!r} is not supported; only text parts "
                          f"({', '.join(TEXT_PARTS)}) are", f"{where}.type",
                          "unsupported_value")
    return _text(part, "text", where, empty=True)


def _output(value: Any, where: str) -> str:
    """A call's output: a string, or text parts (joined by newlines, as chat joins parts)."""
    if isinstance(value, str):
        return checked_text(value)
    if isinstance(value, list) and value:
        return "\n".join(_part(part, f"{where}[{j}]") for j, part in enumerate(value))
    raise _invalid(f"{where} must be a string or a non-empty list of input_text parts", where)


def _texts(item: JSON, key: str, kind: str, where: str) -> tuple[str, ...]:
    value = item.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _invalid(f"{where}.{key} must be a list of {kind} parts", f"{where}.{key}")
    texts = []
    for j, part in enumerate(value):
        at = f"{where}.{key}[{j}]"
        if not isinstance(part, dict) or part.get("type") != kind:
            raise _invalid(f"{at} must be {{'type': '{kind}', 'text': ...}}", at)
        texts.append(_text(part, "text", at, empty=True))
    return tuple(texts)


def items_json(items: list[Item]) -> list[JSON]:
    return [item.as_json() for item in items]


def parse_stored(items: list[Any]) -> list[Item]:
    return [parse_item(item, f"stored[{i}]") for i, item in enumerate(items)]
