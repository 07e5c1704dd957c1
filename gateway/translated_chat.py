"""The chat completions path, for APIs translated onto it (Anthropic's Messages, Ollama's).

Such a route turns its body into the chat completions body it means, parsed and checked by
the chat route's own parser; from there it is the chat route's path: the tool plan from the
model's template, its sampling defaults, the generation request, admission against the key,
the output cap, then routing with fallbacks, metering and metrics when it is opened. Only
the answer is the route's own, made from the chat formatter's chunks or body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from backends.base import GenerationRequest
from gateway.guard import Admitted, PromptTokens, admit
from gateway.limits import cap_output
from gateway.middleware import set_model_label
from gateway.openai.requests import ChatCompletionRequest
from gateway.openai.responses import ChatFormatter, ResponseOptions, chat_meta
from gateway.openai.routes import chat_generation
from gateway.openai.sampling import new_request_id
from gateway.state import gateway_state
from routing.registry import ModelEntry


@dataclass(frozen=True)
class PreparedChat:
    entry: ModelEntry
    formatter: ChatFormatter
    request: GenerationRequest


async def prepare_chat(request: Request, chat: ChatCompletionRequest, entry: ModelEntry,
                       constraint: str = "response_format") -> PreparedChat:
    """The chat route's preparation of a checked body for `entry`: tool plan, formatter,
    generation request; its output constraint named `constraint` in the engine's errors."""
    set_model_label(request.scope, entry.name)
    plan, gen_request = await chat_generation(entry, chat, new_request_id())
    options = ResponseOptions(include_reasoning=chat.include_reasoning)
    formatter = ChatFormatter(chat_meta(entry.name), options, plan)
    return PreparedChat(entry, formatter, constraint_named(gen_request, constraint))


def constraint_named(request: GenerationRequest, name: str) -> GenerationRequest:
    """The output constraint (response_format) named as the route's API names it."""
    structured = request.sampling.structured
    if structured is None or structured.source != "response_format" or name == structured.source:
        return request
    renamed = replace(structured, source=name)
    return replace(request, sampling=replace(request.sampling, structured=renamed))


async def admitted(request: Request, entry: ModelEntry, gen_request: GenerationRequest,
                   ) -> tuple[Admitted, GenerationRequest]:
    """Admitted against the caller's key (429 over its limits, before any tokenizing), with
    --max-output-tokens applied to a request that set no limit."""
    backend, cap = entry.router, gateway_state(request).settings.max_output_tokens
    admission = await admit(request, entry.name, PromptTokens(backend, gen_request, cap))
    async with admission.unless_failing():
        gen_request = await cap_output(backend, gen_request, cap, admission.prompt.count)
    return admission, gen_request


def arguments_object(arguments: str) -> dict[str, Any]:
    """A tool call's arguments (JSON text) as the object APIs other than OpenAI's answer; a
    call cut short by the token limit: what parsed, or {}."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
