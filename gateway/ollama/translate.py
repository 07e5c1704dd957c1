"""Ollama's requests -> the chat completions body (or, for a raw /api/generate, the
completions body) the OpenAI routes parse, and Ollama's model names -> the served model.

Ollama's tool calls carry no ids and its tool messages name the tool, not the call: calls in
the history get ids (theirs when they have one), and each tool message answers the earliest
unanswered call of its tool (or the earliest unanswered call), unless it names the call by
`tool_call_id`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from gateway.errors import OpenAIError, bad_request
from gateway.ollama.options import format_fields, sampling_fields, think_fields
from gateway.ollama.schema import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaMessage,
)
from gateway.state import GatewayState
from routing.errors import ModelNotFound
from routing.registry import ModelEntry

JSON = dict[str, Any]
NO_VISION = "images need a vision model, and none is served here; send the content as text"
LATEST = ":latest"


def served_model(state: GatewayState, request: Request, name: str) -> ModelEntry:
    """The served model `name` (or the x-model header) means; `name:latest` is `name`."""
    wanted = (request.headers.get("x-model") or "").strip() or name
    for candidate in (wanted, wanted.removesuffix(LATEST)):
        try:
            return state.models.resolve(candidate)
        except ModelNotFound:
            continue
    raise OpenAIError(404, f'model "{wanted}" is not served here; GET /api/tags lists the '
                      "models this server serves", param="model", code="model_not_found")


@dataclass
class _Calls:
    """The latest assistant turn's tool calls not yet answered: (id, name), in order."""

    pending: list[tuple[str, str]] = field(default_factory=list)

    def answered(self, call_id: str | None, name: str | None, index: int,
                 ) -> tuple[str, str | None]:
        """The call tool message `index` answers: its id, and the tool's name when known."""
        match = next((c for c in self.pending if c[0] == call_id), None) if call_id else None
        if match is None and call_id is None:
            match = next((c for c in self.pending if c[1] == name), None) if name else None
            match = match or (self.pending[0] if self.pending else None)
        if match is None:
            return call_id or f"call_{index}_result", name
        self.pending.remove(match)
        return match[0], name or match[1]


def _assistant(message: OllamaMessage, index: int, calls: _Calls) -> JSON:
    out: JSON = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        calls.pending = []
        out["tool_calls"] = []
        for j, call in enumerate(message.tool_calls):
            call_id = call.id or f"call_{index}_{j}"
            calls.pending.append((call_id, call.function.name))
            out["tool_calls"].append({"id": call_id, "type": "function", "function": {
                "name": call.function.name,
                "arguments": json.dumps(call.function.arguments, ensure_ascii=False)}})
        out["content"] = message.content or None
    if message.thinking:
        out["reasoning_content"] = message.thinking
    return out


def _tool_result(message: OllamaMessage, index: int, calls: _Calls) -> JSON:
    call_id, name = calls.answered(message.tool_call_id, message.tool_name, index)
    out: JSON = {"role": "tool", "tool_call_id": call_id, "content": message.content}
    if name:
        out["name"] = name
    return out


def chat_messages(messages: list[OllamaMessage]) -> list[JSON]:
    calls = _Calls()
    out: list[JSON] = []
    for i, message in enumerate(messages):
        if message.images:
            raise bad_request(NO_VISION, f"messages[{i}].images", "unsupported_content")
        if message.role == "assistant":
            out.append(_assistant(message, i, calls))
        elif message.role == "tool":
            out.append(_tool_result(message, i, calls))
        else:
            out.append({"role": message.role, "content": message.content})
    if messages and messages[-1].role == "assistant":
        raise bad_request("the last message must not be the assistant's: continuing a "
                          "prefilled answer is not supported", f"messages[{len(messages) - 1}]",
                          "invalid_value")
    return out


def _refuse_logprobs(asked: bool | None, where: str) -> None:
    if asked:
        raise bad_request(f"logprobs is not supported on this route; use {where}", "logprobs",
                          "unsupported_parameter")


def chat_body(body: OllamaChatRequest) -> JSON:
    """The chat completions body asking what the /api/chat `body` asks."""
    _refuse_logprobs(body.logprobs, "/v1/chat/completions")
    chat: JSON = {"messages": chat_messages(body.messages), **sampling_fields(body.options),
                  **format_fields(body.format), **think_fields(body.think)}
    if body.tools:
        chat["tools"] = body.tools
    return chat


def _check_generate(body: OllamaGenerateRequest) -> None:
    _refuse_logprobs(body.logprobs, "/v1/completions")
    if body.images:
        raise bad_request(NO_VISION, "images", "unsupported_content")
    if body.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix",
                          "unsupported_parameter")
    if body.template:
        raise bad_request("template is not supported: the model's own chat template is used; "
                          "send raw: true with a prompt formatted as you need", "template",
                          "unsupported_parameter")
    if body.context:
        raise bad_request("context is not supported (answers carry none); send the whole "
                          "conversation to /api/chat instead", "context", "unsupported_parameter")


def generate_body(body: OllamaGenerateRequest) -> JSON:
    """The chat completions body of the /api/generate `body` (its prompt as the user's
    message, after its system prompt); with `raw`, the completions body of the prompt."""
    _check_generate(body)
    fields = {**sampling_fields(body.options), **format_fields(body.format)}
    if body.raw:
        return {"prompt": body.prompt, **fields}
    messages = [{"role": "user", "content": body.prompt}]
    if body.system:
        messages.insert(0, {"role": "system", "content": body.system})
    return {"messages": messages, **fields, **think_fields(body.think)}
