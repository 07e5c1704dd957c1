"""What a chat template knows about tools: its call format, whether it renders `tools`, and
the history rewritten for it (tool definitions and calls as text when it cannot render them).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from gateway.openai.tools.spec import Function, ToolSpecError

FORMATS = ("hermes", "llama3_json", "mistral")
# The template uses the `tools` variable inside a Jinja tag or expression.
_USES_TOOLS = re.compile(r"\{[{%][^}]*\btools\b")


def detect_format(template: str | None) -> str:
    """The call format a model was trained on, judged by its template's markers."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


def takes_tools(template: str | None) -> bool:
    return bool(template and _USES_TOOLS.search(template))


def native_history(messages: list[dict[str, Any]], fmt: str) -> list[dict[str, Any]]:
    """For a template that renders tools: call arguments as objects (transformers' shape);
    Mistral templates also want call ids of exactly 9 letters or digits."""
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [_native_call(call, fmt, f"messages[{i}].tool_calls[{j}]")
                                     for j, call in enumerate(message["tool_calls"])]
        if fmt == "mistral" and isinstance(message.get("tool_call_id"), str):
            message["tool_call_id"] = _mistral_id(message["tool_call_id"])
        out.append(message)
    return out


def _native_call(call: Any, fmt: str, where: str) -> dict[str, Any]:
    name, arguments = _call_parts(call, where)
    out: dict[str, Any] = {"type": "function",
                           "function": {"name": name, "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = _mistral_id(call["id"]) if fmt == "mistral" else call["id"]
    return out


def _call_parts(call: Any, where: str) -> tuple[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolSpecError(f"{where} must be {{'type': 'function', 'function': "
                            "{'name': ..., 'arguments': '<JSON>'}}", where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return name, arguments  # OpenAI takes any string; the template shows it as is
        return name, parsed if isinstance(parsed, dict) else arguments
    return name, arguments


def _mistral_id(call_id: str) -> str:
    return call_id if re.fullmatch(r"[a-zA-Z0-9]{9}", call_id) else hashlib.sha256(
        call_id.encode()).hexdigest()[:9]


def folded_history(messages: list[dict[str, Any]], offered: list[Function],
                   parallel: bool) -> list[dict[str, Any]]:
    """For a template without tool support: the tools in the system message, calls and
    results as Hermes-style text; results go as user turns, which every template accepts."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            response = f"<tool_response>\n{message.get('content', '')}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_results": True})
        elif role == "assistant" and message.get("tool_calls"):
            out.append(_assistant_text(message, i))
        else:
            out.append(dict(message))
    for message in out:
        message.pop("_results", None)
    if offered:
        out = _with_system(out, tool_instructions(offered, parallel))
    return out


def _assistant_text(message: dict[str, Any], index: int) -> dict[str, Any]:
    parts = [message["content"]] if message.get("content") else []
    for j, call in enumerate(message["tool_calls"]):
        name, arguments = _call_parts(call, f"messages[{index}].tool_calls[{j}]")
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        parts.append(f"<tool_call>\n{body}\n</tool_call>")
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = "\n".join(parts)
    return out


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{text}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def tool_instructions(functions: list[Function], parallel: bool) -> str:
    """Short on purpose: it takes prompt space from every request with tools."""
    signatures = "\n".join(json.dumps(f.as_tool()["function"], ensure_ascii=False)
                           for f in functions)
    how_many = "You may make several calls." if parallel else "Call at most one function."
    return (
        f"# Tools\n<tools>\n{signatures}\n</tools>\n"
        'To call a function, answer <tool_call>{"name": <function name>, "arguments": '
        f"<arguments object>}}</tool_call>. {how_many} Results come in <tool_response>."
    )
