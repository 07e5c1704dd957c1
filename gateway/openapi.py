"""The OpenAPI document: every route's request body and answers, declared from pydantic models.

The routes read their bodies by hand (gateway/body.py) so that every client mistake is
answered in OpenAI's error shape; these declarations document them and change nothing at
run time. `documented(...)` gives a route decorator's `responses` and `openapi_extra`;
the models they name travel under `x-switchyard-components` and `install_openapi` hoists
them into `components/schemas` when the document is first built.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, Field

JSON = dict[str, Any]
Mode = Literal["validation", "serialization"]
_REF = "#/components/schemas/{model}"
_COMPONENTS = "x-switchyard-components"
BEARER = "bearer"

_DESCRIPTIONS = {
    400: "The request is invalid (the message and `param` say what to fix).",
    401: "No API key, or an unknown, expired or disabled one (API keys on).",
    403: "The key may not use this model or endpoint.",
    404: "No such model (or resource).",
    409: "The key store is read-only here (keys declared in the config file).",
    413: "The request body or a field of it is too large.",
    422: "The request is invalid.",
    429: "A rate limit or budget is exhausted, or the model is overloaded (see Retry-After).",
    500: "A server bug, or the model failed while generating.",
    502: "An upstream deployment answered badly.",
    503: "No deployment of the model is ready, the key store is unreachable, the request "
         "waited past --queue-timeout, or the server is draining.",
    504: "The request ran past --request-timeout, or an upstream timed out.",
}
# The errors any guarded JSON route may answer; generation adds the server's own.
COMMON_ERRORS = (400, 401, 403, 404, 413, 422, 429, 503)
GENERATION_ERRORS = (*COMMON_ERRORS, 500, 502, 504)
MODEL_HEADER = {
    "name": "x-model", "in": "header", "required": False, "schema": {"type": "string"},
    "description": "The model (or alias) to use; wins over the body's `model` (Envoy routes "
                   "on it). Left out: the body's `model`, else the only model served.",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = Field(description="The request field at fault, if any.")
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, on every route but TGI's (there, only the body limit's 413)."""

    error: ErrorDetail


class TGIErrorResponse(BaseModel):
    """TGI's error body, on its routes (its client maps `error_type` to exceptions)."""

    error: str
    error_type: str


def ref(name: str) -> JSON:
    return {"$ref": _REF.format(model=name)}


def components(model: type[BaseModel], mode: Mode = "validation") -> tuple[JSON, JSON]:
    """A reference to `model` and every schema it needs, keyed by component name."""
    schema = model.model_json_schema(ref_template=_REF, mode=mode)
    found: JSON = dict(schema.pop("$defs", {}))
    found[model.__name__] = schema
    return ref(model.__name__), found


def _use(model: type[BaseModel], found: JSON, mode: Mode) -> JSON:
    """A reference to `model`, its schemas added to `found`."""
    schema, defs = components(model, mode)
    _merge(found, defs)
    return schema


def _json_content(schema: JSON) -> JSON:
    return {"application/json": {"schema": schema}}


def sse_content(data: JSON, *, done: bool) -> JSON:
    """An event stream whose events' `data` is JSON matching `data` (OpenAI ends with [DONE])."""
    payload: JSON = {"type": "string", "contentMediaType": "application/json",
                     "contentSchema": data}
    if done:
        payload = {"type": "string", "if": {"const": "[DONE]"}, "else": payload}
    item = {"type": "object", "required": ["data"], "properties": {
        "data": payload, "event": {"type": "string"}, "id": {"type": "string"},
        "retry": {"type": "integer", "minimum": 0}}}
    return {"text/event-stream": {"itemSchema": item}}


@dataclass(frozen=True)
class Answer:
    """One documented status: a JSON model, an event stream of a model, newline-delimited
    JSON objects of a model (Ollama's streams), or plain text."""

    status: int
    description: str
    model: type[BaseModel] | None = None
    stream: type[BaseModel] | None = None
    stream_done: bool = True  # OpenAI's streams end with `data: [DONE]`; TGI's do not
    lines: type[BaseModel] | None = None  # application/x-ndjson, one object a line
    text: str | None = None  # a plain-text media type
    headers: JSON | None = None

    def render(self, found: JSON) -> JSON:
        content: JSON = {}
        if self.model is not None:
            content.update(_json_content(_use(self.model, found, "serialization")))
        if self.stream is not None:
            schema = _use(self.stream, found, "serialization")
            content.update(sse_content(schema, done=self.stream_done))
        if self.lines is not None:
            schema = _use(self.lines, found, "serialization")
            content["application/x-ndjson"] = {"itemSchema": schema}
        if self.text is not None:
            content[self.text] = {"schema": {"type": "string"}}
        response: JSON = {"description": self.description, "content": content}
        if self.headers:
            response["headers"] = self.headers
        return response


def _error(status: int, error: type[BaseModel], found: JSON) -> JSON:
    schema = _use(error, found, "serialization")
    return {"description": _DESCRIPTIONS.get(status, "Error."), "content": _json_content(schema)}


def documented(
    *answers: Answer, body: type[BaseModel] | None = None,
    errors: Iterable[int] = COMMON_ERRORS, error: type[BaseModel] = ErrorResponse,
    error_overrides: Mapping[int, type[BaseModel]] | None = None, secured: bool = True,
    model_header: bool = False,
) -> JSON:
    """The `responses` and `openapi_extra` keyword arguments of a route decorator.

    `errors` answer in `error`'s shape, but those in `error_overrides` in theirs (the body
    limit's 413 is OpenAI's on every route)."""
    found: JSON = {}
    shapes = {status: error for status in errors} | dict(error_overrides or {})
    responses: dict[int | str, JSON] = {
        status: _error(status, shape, found) for status, shape in shapes.items()}
    for answer in answers:
        responses[answer.status] = answer.render(found)
    extra: JSON = {}
    if body is not None:
        schema = _use(body, found, "validation")
        extra["requestBody"] = {"required": True, "content": _json_content(schema)}
    if secured:
        extra["security"] = [{BEARER: []}]
    if model_header:
        extra["parameters"] = [MODEL_HEADER]
    extra[_COMPONENTS] = found
    return {"responses": responses, "openapi_extra": extra}


def _merge(schemas: JSON, found: JSON) -> None:
    for name, schema in found.items():
        if schemas.setdefault(name, schema) != schema:
            raise RuntimeError(f"two different OpenAPI schemas are named {name!r}")


def _hoist(document: JSON) -> None:
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    secured = False
    for path_item in document.get("paths", {}).values():
        for operation in path_item.values():
            if isinstance(operation, dict):
                _merge(schemas, operation.pop(_COMPONENTS, {}))
                secured = secured or "security" in operation
    if secured:
        document["components"].setdefault("securitySchemes", {})[BEARER] = {
            "type": "http", "scheme": "bearer",
            "description": "An API key (`sk-sy-...`) or the admin key, when API keys are on; "
                           "without them the gateway is open.",
        }


def install_openapi(app: FastAPI) -> None:
    """Build `app`'s document with the declared models hoisted into its components."""
    build = app.openapi

    def openapi() -> JSON:
        if app.openapi_schema is None:
            _hoist(build())
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
