"""A Responses request -> the chat completion request it amounts to.

The conversation's items become chat messages (the instructions first, as a system message;
consecutive function calls one assistant message with `tool_calls`; a function call's output
a `tool` message; reasoning the next assistant message's `reasoning_content`), the flat
function tools chat's nested ones, `text.format` a `response_format`. The result is parsed and
checked by the chat route's own request model, so both routes take the same path from here.
Errors raised on the way name the chat request's fields; `responses_errors` renames them to
the Responses fields they came from.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from gateway.body import parse_body
from gateway.errors import OpenAIError, bad_request, to_openai_error
from gateway.limits import check_openai_fields
from gateway.openai.requests import ChatCompletionRequest
from gateway.responses_api.items import (
    FunctionCallItem,
    FunctionOutputItem,
    Item,
    MessageItem,
    ReasoningItem,
)
from gateway.responses_api.request import ResponsesRequest
from gateway.settings import RequestLimits

JSON = dict[str, Any]
# Chat request fields, as errors name them -> the Responses field they came from. A message
# is named by its index (`messages[2].content`) or quoted ('messages'); prose about chat
# messages stays as it is.
_RENAMES = (
    (re.compile(r"(?<![\w-])messages\[\d+\](\.[\w.\[\]]+)?|^messages$"), "input"),
    (re.compile(r"'messages'"), "'input'"),
    (re.compile(r"\btools(\[\d+\])\.function\b"), r"tools\1"),
    (re.compile(r"\bmax_(completion_)?tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format(\.json_schema)?"), "text.format"),
)


def _renamed(text: str) -> str:
    for pattern, replacement in _RENAMES:
        text = pattern.sub(replacement, text)
    return text


def renamed(err: OpenAIError) -> OpenAIError:
    """The error with chat field names replaced by the Responses fields they came from."""
    err.message = _renamed(err.message)
    if err.param is not None:
        err.param = _renamed(err.param)
    return err


@contextmanager
def responses_errors() -> Iterator[None]:
    """Errors raised inside name the Responses request's fields."""
    try:
        yield
    except Exception as exc:
        err = to_openai_error(exc)
        if err is None:
            raise
        raise renamed(err) from exc


def _parts(texts: Sequence[str]) -> list[JSON]:
    return [{"type": "text", "text": text} for text in texts]


def _call(item: FunctionCallItem) -> JSON:
    return {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.arguments}}


class _Conversation:
    """Chat messages built item by item."""

    def __init__(self) -> None:
        self.messages: list[JSON] = []
        self._reasoning: list[str] = []  # for the next assistant message
        self._open_calls = False  # the last message is an assistant's that may take more calls

    def add(self, item: Item) -> None:
        if isinstance(item, ReasoningItem):
            self._reasoning.extend(item.texts)
            return
        if isinstance(item, FunctionCallItem):
            self._add_call(item)
            return
        self._open_calls = False
        if isinstance(item, FunctionOutputItem):
            self.messages.append({"role": "tool", "tool_call_id": item.call_id,
                                  "content": item.output})
        elif isinstance(item, MessageItem):
            message: JSON = {"role": item.role, "content": _parts(item.texts)}
            if item.role == "assistant":
                self._with_reasoning(message)
                self._open_calls = True
            self.messages.append(message)

    def _add_call(self, item: FunctionCallItem) -> None:
        if self._open_calls:
            self.messages[-1].setdefault("tool_calls", []).append(_call(item))
            return
        message: JSON = {"role": "assistant", "content": None, "tool_calls": [_call(item)]}
        self._with_reasoning(message)
        self.messages.append(message)
        self._open_calls = True

    def _with_reasoning(self, message: JSON) -> None:
        if self._reasoning:
            message["reasoning_content"] = "\n".join(self._reasoning)
            self._reasoning = []


def chat_messages(instructions: str | None, items: Sequence[Item]) -> list[JSON]:
    conversation = _Conversation()
    if instructions:
        conversation.messages.append({"role": "system", "content": instructions})
    for item in items:
        conversation.add(item)
    return conversation.messages


def _chat_tools(tools: list[JSON]) -> list[JSON]:
    keys = ("name", "description", "parameters", "strict")
    return [{"type": "function", "function": {k: t[k] for k in keys if t.get(k) is not None}}
            for t in tools]


def _chat_tool_choice(choice: str | JSON | None) -> str | JSON | None:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(fmt: JSON) -> JSON | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_schema":
        spec = {k: v for k, v in fmt.items() if k != "type"}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": kind}


def chat_body(body: ResponsesRequest, items: Sequence[Item],
              limits: RequestLimits) -> ChatCompletionRequest:
    """The chat completion request of `body` with the conversation `items`."""
    messages = chat_messages(body.instructions, items)
    if not messages:
        raise bad_request("input is required (a string or a list of items), unless "
                          "previous_response_id continues a stored conversation",
                          "input", "missing_required_parameter")
    data: JSON = {
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "user": body.user,
        "tools": _chat_tools(body.tools) if body.tools else None,
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text_format()),
    }
    data = {key: value for key, value in data.items() if value is not None}
    with responses_errors():
        check_openai_fields(data, limits)
        chat = parse_body(data, ChatCompletionRequest)
        chat.check()
    return chat
