"""Output constraints a request may ask for -> the contract's `StructuredOutput`.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and vLLM's extensions
(`structured_outputs`, and the older `guided_json` / `guided_regex` / `guided_grammar` /
`guided_choice`). Only the shape is checked here; a schema or grammar the grammar engine
cannot compile is the backend's 400.
"""

from __future__ import annotations

import json
from typing import Any

from backends.base import StructuredOutput
from gateway.openai.messages import invalid

_REGEX_SPECIAL = set("\\.^$*+?()[]{}|/")


def response_format(value: Any) -> StructuredOutput | None:
    """OpenAI's `response_format` object; `text` (or nothing) is no constraint."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("response_format must be an object like {'type': 'json_object'}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        return _json_schema(value.get("json_schema"))
    raise invalid(f"response_format.type {kind!r} is not one of 'text', 'json_object', "
                  "'json_schema'")


def _json_schema(spec: Any) -> StructuredOutput:
    if not isinstance(spec, dict):
        raise invalid("response_format.json_schema must be an object with 'name' and 'schema'")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise invalid("response_format.json_schema.name must be a non-empty string")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("response_format.json_schema.strict must be a boolean")
    schema = spec.get("schema")
    if schema is None:  # OpenAI allows leaving it out: any JSON object then
        return StructuredOutput("json_object", name=name, strict=strict)
    if not isinstance(schema, dict):
        raise invalid("response_format.json_schema.schema must be a JSON Schema object")
    return StructuredOutput("json_schema", json.dumps(schema), name=name, strict=strict)


def regex_of_choices(choices: Any, field: str) -> StructuredOutput:
    if not isinstance(choices, list) or not choices or not all(
            isinstance(c, str) for c in choices):
        raise invalid(f"{field} must be a non-empty list of strings")
    escaped = ("".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in c) for c in choices)
    return StructuredOutput("regex", "(" + "|".join(escaped) + ")", source=_source(field))


def _source(field: str) -> str:
    """The top-level request parameter of `field` (`structured_outputs.json` -> its head)."""
    return field.split(".", 1)[0]


def _schema_text(value: Any, field: str) -> StructuredOutput:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise invalid(f"{field} is not valid JSON") from None
    if not isinstance(value, dict):
        raise invalid(f"{field} must be a JSON Schema object")
    return StructuredOutput("json_schema", json.dumps(value), source=_source(field))


def _text_spec(value: Any, field: str, kind: str) -> StructuredOutput:
    if not isinstance(value, str) or not value:
        raise invalid(f"{field} must be a non-empty string")
    return StructuredOutput(kind, value, source=_source(field))  # type: ignore[arg-type]


def _one(constraints: list[StructuredOutput], field: str) -> StructuredOutput | None:
    if len(constraints) > 1:
        raise invalid(f"{field}: give only one of json, regex, grammar, choice")
    return constraints[0] if constraints else None


def structured_outputs(value: Any) -> StructuredOutput | None:
    """vLLM's `structured_outputs`: {"json" | "regex" | "grammar" | "choice" | "json_object"}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("structured_outputs must be an object like {'regex': '...'}")
    found: list[StructuredOutput] = []
    if value.get("json") is not None:
        found.append(_schema_text(value["json"], "structured_outputs.json"))
    if value.get("regex") is not None:
        found.append(_text_spec(value["regex"], "structured_outputs.regex", "regex"))
    if value.get("grammar") is not None:
        found.append(_text_spec(value["grammar"], "structured_outputs.grammar", "lark"))
    if value.get("choice") is not None:
        found.append(regex_of_choices(value["choice"], "structured_outputs.choice"))
    if value.get("json_object"):
        found.append(StructuredOutput("json_object", source="structured_outputs"))
    return _one(found, "structured_outputs")


def guided(kind: str, value: Any) -> StructuredOutput | None:
    """One of vLLM's older `guided_*` fields."""
    if value is None:
        return None
    field = f"guided_{kind}"
    if kind == "json":
        return _schema_text(value, field)
    if kind == "choice":
        return regex_of_choices(value, field)
    return _text_spec(value, field, "regex" if kind == "regex" else "lark")
