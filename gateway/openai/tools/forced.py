"""The JSON schema that forces calls (tool_choice "required" or a named function).

The output is a JSON array of `{"name": <a function>, "arguments": <its parameters>}`
(one item unless parallel calls are allowed); `ToolCallParser("forced", ...)` reads it.
Undeclared arguments are refused unless the parameters allow them explicitly. A function's
own `$defs` are lifted to the top, renamed, so its `$ref`s still resolve.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from gateway.openai.tools.spec import Function

_DEFS = ("$defs", "definitions")


def forced_schema(functions: list[Function], parallel: bool) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    calls = [_call(f, f"fn{i}", defs) for i, f in enumerate(functions)]
    schema: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def forced_spec(functions: list[Function], parallel: bool) -> str:
    return json.dumps(forced_schema(functions, parallel))


def _call(function: Function, key: str, defs: dict[str, Any]) -> dict[str, Any]:
    parameters = copy.deepcopy(function.parameters)
    recursive: list[bool] = []  # set when a $ref points at the parameters' root
    for section in _DEFS:
        for name, sub in (parameters.pop(section, None) or {}).items():
            defs[f"{key}_{name}"] = _rerooted(sub, key, recursive)
    parameters = _rerooted(parameters, key, recursive)
    # Arguments the function does not declare are no call to it (OpenAI's strict mode agrees);
    # left open, a weak model could also fill an object with made-up keys until max_tokens.
    parameters.setdefault("additionalProperties", False)
    if recursive:
        defs[key] = parameters
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _rerooted(node: Any, key: str, recursive: list[bool]) -> Any:
    """`node` with its `$ref`s pointing where the function's definitions now live."""
    if isinstance(node, list):
        return [_rerooted(item, key, recursive) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rerooted(v, key, recursive) for k, v in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str):
        out["$ref"] = _ref(ref, key, recursive)
    return out


def _ref(ref: str, key: str, recursive: list[bool]) -> str:
    for section in _DEFS:
        prefix = f"#/{section}/"
        if ref.startswith(prefix):
            return f"#/$defs/{key}_{ref[len(prefix):]}"
    if ref == "#":
        recursive.append(True)
        return f"#/$defs/{key}"
    return ref
