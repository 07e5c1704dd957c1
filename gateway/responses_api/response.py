"""The response object: its id, status, output and usage, and what it echoes of its request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from backends.base import SamplingParams, Usage
from gateway.responses_api.request import ResponsesRequest

JSON = dict[str, Any]


def usage_json(usage: Usage) -> JSON:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
        "total_tokens": usage.total_tokens,
    }


def _tool(tool: JSON) -> JSON:
    return {"type": "function", "name": tool.get("name"),
            "description": tool.get("description"), "parameters": tool.get("parameters"),
            "strict": tool.get("strict")}


def _text_config(body: ResponsesRequest) -> JSON:
    config: JSON = {"format": body.text_format()}
    verbosity = (body.text or {}).get("verbosity")
    if verbosity is not None:
        config["verbosity"] = verbosity
    return config


def _reasoning(body: ResponsesRequest) -> JSON:
    asked = body.reasoning or {}
    return {"effort": asked.get("effort"), "summary": asked.get("summary")}


@dataclass(frozen=True)
class ResponseHead:
    """What every state of one response shares: fixed before generation starts."""

    id: str
    model: str
    echo: JSON  # the request's settings, as the response object shows them
    store: bool
    created_at: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def of(cls, response_id: str, body: ResponsesRequest, model: str,
           sampling: SamplingParams) -> ResponseHead:
        echo: JSON = {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "metadata": dict(body.metadata or {}),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": _reasoning(body),
            "temperature": sampling.temperature,
            "text": _text_config(body),
            "tool_choice": body.tool_choice or "auto",
            "tools": [_tool(t) for t in body.tools or []],
            "top_p": sampling.top_p,
            "truncation": body.truncation or "disabled",
            "user": body.user,
        }
        return cls(response_id, model, echo, body.stores())

    def body(self, status: str, output: list[JSON] | None = None, usage: Usage | None = None,
             error: JSON | None = None) -> JSON:
        """The response object in `status`: in_progress, completed, incomplete or failed."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": error,
            "incomplete_details": incomplete, "model": self.model, "output": output or [],
            "usage": usage_json(usage) if usage is not None else None,
            "store": self.store, **self.echo,
            "completed_at": int(time.time()) if status == "completed" else None,
        }


def finished_status(finish_reason: str | None) -> str:
    """A generation cut at its token limit is incomplete; any other end completes it."""
    return "incomplete" if finish_reason == "length" else "completed"
