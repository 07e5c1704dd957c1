"""A `StructuredOutput` as llguidance grammar text, with errors a person can act on.

JSON is generated with fixed separators (", " and ": ") and no other whitespace: a model with
random or weak weights would otherwise be free to emit whitespace forever, and the fixed form is
the one `json.dumps` writes, which models have seen most. Our options are passed as llguidance
`overrides`, so an "x-guidance" key inside a client's schema cannot loosen them.
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher

from backends.base import StructuredOutput

JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,  # an unsupported keyword is an error, never silently unenforced
}
_WHAT = {
    "json_object": "JSON object grammar",
    "json_schema": "JSON schema",
    "regex": "regular expression",
    "lark": "Lark grammar",
}


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message names the problem (becomes a 400)."""


def describe(kind: str) -> str:
    return _WHAT.get(kind, kind)


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for `spec`; GrammarError for a schema that is not JSON."""
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if spec.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(_parse_schema(spec.spec), overrides=JSON_OPTIONS)
    if spec.kind == "regex":
        if not spec.spec:
            raise GrammarError("The regular expression is empty.")
        return LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "lark":
        if not spec.spec.strip():
            raise GrammarError("The Lark grammar is empty.")
        return LLMatcher.grammar_from_lark(spec.spec)
    raise GrammarError(f"Unknown structured output kind {spec.kind!r}.")


def _parse_schema(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"The JSON schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise GrammarError(
            f"The JSON schema must be a JSON object, not {type(schema).__name__}."
        )
    return schema
