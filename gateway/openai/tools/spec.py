"""Validation of a request's `tools` and `tool_choice` (OpenAI's shapes)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
CHOICES = ("none", "auto", "required")


class ToolSpecError(ValueError):
    """A client mistake in `tools`, `tool_choice` or the tool history: a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI `tools` entry handed to the chat template."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class Choice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, when named


def check_tools(tools: Any) -> list[Function]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolSpecError("tools must be a list of {'type': 'function', 'function': ...}",
                            "tools")
    functions = [_function(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    seen: set[str] = set()
    for i, function in enumerate(functions):
        if function.name in seen:
            raise ToolSpecError(f"two tools are named {function.name!r}; names must be unique",
                                f"tools[{i}].function.name")
        seen.add(function.name)
    return functions


def _function(tool: Any, where: str) -> Function:
    if not isinstance(tool, dict):
        raise ToolSpecError(f"{where} must be an object like {{'type': 'function', "
                            "'function': {'name': ..., 'parameters': {...}}}", where)
    if tool.get("type") != "function":
        raise ToolSpecError(f"{where}.type must be 'function' (got {tool.get('type')!r})",
                            f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolSpecError(f"{where}.function must be an object with a 'name'",
                            f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolSpecError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or "
                            f"'-' (got {name!r})", f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolSpecError(f"{where}.function.description must be a string",
                            f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(EMPTY_PARAMETERS)
    _check_parameters(parameters, f"{where}.function.parameters")
    return Function(name, description, parameters)


def _check_parameters(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise ToolSpecError(f"{where} must be a JSON Schema object, like "
                            "{'type': 'object', 'properties': {...}}", where)
    if "type" in schema and schema["type"] != "object":
        raise ToolSpecError(f"{where}.type must be 'object': a function takes named "
                            f"arguments (got {schema['type']!r})", f"{where}.type")
    if not isinstance(schema.get("properties", {}), dict):
        raise ToolSpecError(f"{where}.properties must be an object mapping names to schemas",
                            f"{where}.properties")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ToolSpecError(f"{where}.required must be a list of property names",
                            f"{where}.required")


def check_choice(choice: Any, functions: list[Function]) -> Choice:
    """None means "auto" with tools and "none" without, as OpenAI does."""
    if choice is None:
        return Choice("auto" if functions else "none")
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ToolSpecError(f"tool_choice must be one of {', '.join(CHOICES)} or "
                                "{'type': 'function', 'function': {'name': ...}} "
                                f"(got {choice!r})", "tool_choice")
        if choice == "required" and not functions:
            raise ToolSpecError("tool_choice 'required' needs tools", "tool_choice")
        return Choice(choice)
    name = _named(choice)
    if name not in {f.name for f in functions}:
        declared = ", ".join(repr(f.name) for f in functions) or "none"
        raise ToolSpecError(f"tool_choice names function {name!r}, which is not among the "
                            f"tools (declared: {declared})", "tool_choice")
    return Choice("named", name)


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(
            name, str):
        raise ToolSpecError("a named tool_choice must look like {'type': 'function', "
                            "'function': {'name': ...}}", "tool_choice")
    return name
