"""TGI's `grammar` parameter: `{"type": "json", "value": <schema>}` or
`{"type": "regex", "value": "<regex>"}`, turned into a `StructuredOutput`.

Faithful to TGI's router: the shape is checked as serde checks an adjacently tagged enum
(those errors read "Failed to deserialize the JSON body ..."), a JSON schema may be an
object or a string holding one (a string that does not parse is "grammar is not valid"),
any other JSON value is "grammar is not supported". `json_object` is TGI's alias of `json`.
Whether the schema or regex compiles is the grammar engine's call: the backend refuses
what it cannot compile, and the route reports that as "grammar is not valid: ...".
"""

from __future__ import annotations

import json
from typing import Any

from backends.base import StructuredOutput

_DESERIALIZE = "Failed to deserialize the JSON body into the target type: parameters.grammar: "
_KINDS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex"}


class GrammarShapeError(Exception):
    """A `grammar` TGI refuses (422); `message` is TGI's."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _json_kind(value: Any) -> str:
    """serde's spelling of a JSON value's type, for its `invalid type` messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def _schema(value: Any) -> str:
    """The JSON schema's text, from an object or a string holding one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise GrammarShapeError(f"grammar is not valid: {exc}") from None
        if not isinstance(value, dict):
            raise GrammarShapeError(
                f"grammar is not valid: a JSON schema must be an object, got {_json_kind(value)}")
        return json.dumps(value)
    if isinstance(value, dict):
        return json.dumps(value)
    raise GrammarShapeError("grammar is not supported")


def parse_grammar(grammar: Any) -> StructuredOutput:
    if not isinstance(grammar, dict):
        raise GrammarShapeError(
            f"{_DESERIALIZE}invalid type: {_json_kind(grammar)}, "
            "expected adjacently tagged enum GrammarType")
    if "type" not in grammar:
        raise GrammarShapeError(f"{_DESERIALIZE}missing field `type`")
    kind = grammar["type"]
    if not isinstance(kind, str):
        raise GrammarShapeError(
            f"{_DESERIALIZE}invalid type: {_json_kind(kind)}, expected variant identifier")
    if kind not in _KINDS:
        raise GrammarShapeError(
            f"{_DESERIALIZE}unknown variant `{kind}`, expected `json` or `regex`")
    if "value" not in grammar:
        raise GrammarShapeError(f"{_DESERIALIZE}missing field `value`")
    value = grammar["value"]
    if kind == "regex":
        if not isinstance(value, str):
            raise GrammarShapeError(
                f"{_DESERIALIZE}invalid type: {_json_kind(value)}, expected a string")
        return StructuredOutput("regex", value, source="grammar")
    return StructuredOutput("json_schema", _schema(value), source="grammar")
