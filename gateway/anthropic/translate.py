"""Anthropic's Messages request -> the chat completions body the OpenAI route parses, and the
chat completion it answers -> Anthropic's message.

Going through the chat completion's own body and formatter keeps one path: the same
validation, tool plan, grammar, sampling defaults and tool-call parsing, so a conversation
gets the same tokens through either API.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from backends.base import Usage
from gateway.anthropic.schema import (
    AnthropicConversationFields,
    AnthropicImageBlock,
    AnthropicInputMessage,
    AnthropicMessagesRequest,
    AnthropicRedactedThinkingBlock,
    AnthropicTextBlock,
    AnthropicThinkingBlock,
    AnthropicToolChoiceAny,
    AnthropicToolChoiceNone,
    AnthropicToolChoiceTool,
    AnthropicToolResultBlock,
    AnthropicToolUseBlock,
)
from gateway.errors import OpenAIError, bad_request
from gateway.settings import RequestLimits
from gateway.translated_chat import arguments_object

JSON = dict[str, Any]
NO_VISION = ("image content blocks need a vision model, and none is served here; send the "
             "content as text")


def check_fields(data: Any, limits: RequestLimits) -> None:
    """The request limits, on the raw body before it is validated (as the OpenAI routes do)."""
    if not isinstance(data, dict):
        return
    messages, stops = data.get("messages"), data.get("stop_sequences")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise _too_many("messages", limits.max_messages, len(messages))
    if isinstance(stops, list):
        if len(stops) > limits.max_stop_sequences:
            raise _too_many("stop_sequences", limits.max_stop_sequences, len(stops))
        for i, stop in enumerate(stops):
            if isinstance(stop, str) and len(stop) > limits.max_stop_length:
                raise bad_request(f"stop_sequences[{i}] is {len(stop)} characters long; at "
                                  f"most {limits.max_stop_length} are allowed",
                                  f"stop_sequences[{i}]", "string_above_max_length")
    value, cap = data.get("max_tokens"), limits.max_output_tokens
    if cap is not None and isinstance(value, int) and not isinstance(value, bool) and value > cap:
        raise bad_request(f"max_tokens is too large: {value}. This server allows at most {cap} "
                          "generated tokens per request.", "max_tokens", "invalid_value")


def _too_many(field: str, limit: int, got: int) -> OpenAIError:
    return bad_request(f"{field} has {got} items; at most {limit} are allowed", field,
                       "array_above_max_length")


def _text(blocks: list[AnthropicTextBlock]) -> str:
    return "\n".join(block.text for block in blocks)


def _tool_result(block: AnthropicToolResultBlock, where: str) -> JSON:
    if isinstance(block.content, str):
        text = block.content
    else:
        if any(isinstance(part, AnthropicImageBlock) for part in block.content):
            raise bad_request(NO_VISION, f"{where}.content", "unsupported_content")
        text = _text([part for part in block.content if isinstance(part, AnthropicTextBlock)])
    if block.is_error:  # the model should know the call failed
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _user(message: AnthropicInputMessage, where: str) -> list[JSON]:
    """Tool results first (each a `tool` message answering its call), then the text."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    results, texts = [], []
    for j, block in enumerate(message.content):
        place = f"{where}.content[{j}]"
        if isinstance(block, AnthropicToolResultBlock):
            results.append(_tool_result(block, place))
        elif isinstance(block, AnthropicTextBlock):
            texts.append(block)
        elif isinstance(block, AnthropicImageBlock):
            raise bad_request(NO_VISION, place, "unsupported_content")
        else:
            raise bad_request(f"a user message cannot hold a {block.type!r} block", place,
                              "invalid_value")
    return results + ([{"role": "user", "content": _text(texts)}] if texts else [])


def _assistant(message: AnthropicInputMessage, where: str) -> JSON:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, calls, reasoning = [], [], []
    for j, block in enumerate(message.content):
        if isinstance(block, AnthropicTextBlock):
            texts.append(block.text)
        elif isinstance(block, AnthropicToolUseBlock):
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, AnthropicThinkingBlock):
            reasoning.append(block.thinking)
        elif not isinstance(block, AnthropicRedactedThinkingBlock):
            raise bad_request(f"an assistant message cannot hold a {block.type!r} block",
                              f"{where}.content[{j}]", "invalid_value")
    out: JSON = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    return out


def chat_messages(body: AnthropicConversationFields) -> list[JSON]:
    messages: list[JSON] = []
    if body.system is not None:
        system = body.system if isinstance(body.system, str) else _text(body.system)
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        if message.role == "user":
            messages.extend(_user(message, where))
        else:
            messages.append(_assistant(message, where))
    if body.messages[-1].role == "assistant":
        raise bad_request("the last message must be the user's: continuing a prefilled "
                          "assistant turn is not supported", f"messages[{len(body.messages) - 1}]",
                          "invalid_value")
    return messages


def _tools(body: AnthropicConversationFields) -> JSON:
    out: JSON = {}
    if body.tools:
        out["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description or "",
            "parameters": tool.input_schema}} for tool in body.tools]
    choice = body.tool_choice
    if choice is None:
        return out
    if isinstance(choice, AnthropicToolChoiceNone):
        out["tool_choice"] = "none"
        return out
    if isinstance(choice, AnthropicToolChoiceTool):
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = "required" if isinstance(choice, AnthropicToolChoiceAny) else "auto"
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    if out["tool_choice"] != "auto" and not body.tools:
        raise bad_request(f"tool_choice {choice.type!r} needs tools", "tool_choice",
                          "invalid_value")
    return out


def conversation_body(body: AnthropicConversationFields) -> JSON:
    """The chat completions body of the conversation alone (what count_tokens templates)."""
    chat: JSON = {"messages": chat_messages(body), **_tools(body)}
    if body.model is not None:
        chat["model"] = body.model
    if body.thinking is not None and body.thinking.type == "disabled":
        chat["chat_template_kwargs"] = {"enable_thinking": False}
        chat["include_reasoning"] = False
    return chat


def chat_body(body: AnthropicMessagesRequest) -> JSON:
    """The chat completions body asking what `body` asks."""
    chat = conversation_body(body)
    chat["max_tokens"] = body.max_tokens
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    output = body.output_config.format if body.output_config is not None else None
    if output is not None:
        if chat.get("tool_choice") not in (None, "none", "auto"):
            raise bad_request("output_config.format cannot be combined with a forced tool "
                              "call (tool_choice 'any' or 'tool')", "output_config.format",
                              "invalid_value")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": output.schema_, "strict": True}}
    if body.metadata is not None and body.metadata.user_id is not None:
        chat["user"] = body.metadata.user_id
    return chat


# ---- the answer ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ending:
    """How the choice ended, in the backend's terms."""

    finish_reason: str  # the chat completion's: stop, length, tool_calls
    stop_reason: str | None = None  # the backend's: eos_token, stop_sequence
    stop_sequence: str | None = None


def stop_fields(ending: Ending, stops: list[str] | None) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence)."""
    if ending.finish_reason == "tool_calls":
        return "tool_use", None
    if ending.finish_reason == "length":
        return "max_tokens", None
    if ending.stop_reason == "stop_sequence":
        matched = ending.stop_sequence
        if matched is None and stops is not None and len(stops) == 1:
            matched = stops[0]  # a backend that cannot say which: the only one it could be
        return "stop_sequence", matched
    return "end_turn", None


def usage_body(usage: Usage) -> JSON:
    cached = min(usage.cached_tokens, usage.prompt_tokens)
    return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def content_blocks(message: JSON) -> list[JSON]:
    """The chat completion's message as content blocks: thinking, text, then tool uses."""
    blocks: list[JSON] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                       "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": arguments_object(call["function"]["arguments"])})
    return blocks


def message_body(chat: JSON, ending: Ending, usage: Usage, stops: list[str] | None,
                 message_id: str) -> JSON:
    """The chat completion `chat` (one choice) as Anthropic's message."""
    choice = chat["choices"][0]
    stop_reason, stop_sequence = stop_fields(
        Ending(choice["finish_reason"], ending.stop_reason, ending.stop_sequence), stops)
    return {"id": message_id, "type": "message", "role": "assistant", "model": chat["model"],
            "content": content_blocks(choice["message"]), "stop_reason": stop_reason,
            "stop_sequence": stop_sequence, "usage": usage_body(usage)}
