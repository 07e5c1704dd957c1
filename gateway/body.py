"""Reading a JSON request body into a schema, with OpenAI-shaped 400s for every mistake."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from gateway.errors import bad_request, from_validation_errors

Body = TypeVar("Body", bound=BaseModel)


async def read_json(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        message = f"The request body is not valid JSON: {exc}"
        raise bad_request(message, code="invalid_json") from None


def parse_body(data: Any, schema: type[Body]) -> Body:
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_type")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None
