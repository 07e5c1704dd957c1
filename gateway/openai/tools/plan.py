"""A request's tool plan: what the template gets, what constrains decoding, how to parse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.base import StructuredOutput
from gateway.openai.tools.forced import forced_spec
from gateway.openai.tools.parser import ToolCallParser
from gateway.openai.tools.spec import Choice, Function, check_choice, check_tools
from gateway.openai.tools.templates import (
    FORMATS,
    detect_format,
    folded_history,
    native_history,
    takes_tools,
)


@dataclass(frozen=True)
class ToolPlan:
    functions: tuple[Function, ...]
    choice: Choice
    format: str  # "hermes" | "llama3_json" | "mistral"
    native: bool  # the chat template renders `tools` itself
    parallel: bool

    @property
    def offered(self) -> list[Function]:
        """The functions the model is told about ("none" tells it of none)."""
        return [] if self.choice.mode == "none" else list(self.functions)

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """`GenerationRequest.tools`: None unless the template renders them."""
        offered = self.offered
        return [f.as_tool() for f in offered] if self.native and offered else None

    @property
    def structured(self) -> StructuredOutput | None:
        """A JSON grammar forcing the call(s) when tool_choice is "required" or named."""
        forced = self._forced()
        if forced is None:
            return None
        # A named function is called once; "required" may call several when parallel.
        parallel = self.parallel and self.choice.mode == "required"
        return StructuredOutput("json_schema", forced_spec(forced, parallel), source="tools")

    def _forced(self) -> list[Function] | None:
        if self.choice.mode == "required":
            return list(self.functions)
        if self.choice.mode == "named":
            return [f for f in self.functions if f.name == self.choice.name]
        return None

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The history ready for the chat template (ToolSpecError for a malformed call)."""
        if self.native:
            return native_history(messages, self.format)
        return folded_history(messages, self.offered, self.parallel)

    def parser(self) -> ToolCallParser | None:
        """A fresh parser for one choice's output; None when no call can come."""
        forced = self._forced()
        if forced is not None:
            return ToolCallParser("forced", [f.name for f in forced])
        offered = self.offered
        if not offered:
            return None
        return ToolCallParser(self.format, [f.name for f in offered])


def plan_tools(
    tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool, chat_template: str | None, parser_override: str | None = None,
) -> ToolPlan:
    """ToolSpecError for invalid tools or a tool_choice they cannot satisfy."""
    if parser_override is not None and parser_override not in FORMATS:
        raise ValueError(f"unknown tool call parser {parser_override!r}; "
                         f"expected one of {', '.join(FORMATS)}")
    functions = check_tools(tools)
    choice = check_choice(tool_choice, functions)
    return ToolPlan(
        functions=tuple(functions), choice=choice,
        format=parser_override or detect_format(chat_template),
        native=takes_tools(chat_template), parallel=parallel_tool_calls,
    )
