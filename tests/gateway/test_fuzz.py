"""Schemathesis over the served OpenAPI document: every route, bodies included.

A real uvicorn server serving the echo backend, with API keys off, and on (a real Redis)
with the admin key or an ordinary key. Each operation gets a bounded, derandomized run of
valid and invalid requests (Hypothesis). Every answer must be: no 5xx, in time, a declared
status and content type, a body matching the declared schema, and every 4xx in the route's
error shape (OpenAI's, TGI's on TGI's routes, Anthropic's on the Messages routes, Ollama's
under /api/).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.anthropic.errors import MESSAGES_PATHS
from gateway.anthropic.schema import AnthropicErrorResponse
from gateway.app import create_app
from gateway.ollama.errors import is_ollama_path
from gateway.ollama.schema import OllamaErrorResponse
from gateway.openapi import ErrorResponse, TGIErrorResponse
from gateway.settings import Settings
from tests.auth.conftest import RedisServer
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend
from tests.gateway.echo_embedding import EchoEmbeddingBackend

# Per operation: bounded and derandomized for CI; raise it to dig deeper.
MAX_EXAMPLES = int(os.environ.get("SWITCHYARD_FUZZ_EXAMPLES", "25"))
REQUEST_TIMEOUT_S = 10.0
MODEL = "echo"
EMBED_MODEL = "echo-embed"  # an embedding model: the embedding routes are aimed at it
EMBEDDING_PATHS = ("/v1/embeddings", "/api/embed", "/api/embeddings")
TGI_ROUTES = frozenset({"/generate", "/generate_stream", "/", "/info"})
ADMIN_KEY = "sy-admin-" + secrets.token_urlsafe(32)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def _operations() -> list[str]:
    """Every documented operation (the document does not depend on what is served)."""
    app = create_app(Settings(), backends={MODEL: EchoBackend(name=MODEL)})
    document = app.openapi()
    return [f"{method.upper()} {path}" for path, item in document["paths"].items()
            for method in item]


@dataclass(frozen=True)
class Target:
    url: str
    schema: schemathesis.BaseSchema
    headers: dict[str, str]


def _serve(settings: Settings) -> Iterator[str]:
    backends = {MODEL: EchoBackend(name=MODEL, max_total_tokens=256),
                EMBED_MODEL: EchoEmbeddingBackend(name=EMBED_MODEL)}
    with running_server(create_app(settings, backends=backends)) as url:
        yield url


@pytest.fixture(scope="module")
def open_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # Stored responses go to the cache directory: a temporary one.
    yield from _serve(Settings(cache_dir=str(tmp_path_factory.mktemp("cache"))))


@pytest.fixture(scope="module")
def keyed_url(redis_server: RedisServer) -> Iterator[str]:
    yield from _serve(Settings(admin_key=ADMIN_KEY, redis_url=redis_server.url))


def _user_key(url: str) -> str:
    """An ordinary key for `echo`, with limits loose enough to fuzz under."""
    response = httpx.post(f"{url}/admin/keys", json={"name": "fuzz",
                                                     "models": [MODEL, EMBED_MODEL],
                                                     "rpm": 100_000, "parallel": 8},
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert response.status_code == 201, response.text
    return response.json()["key"]


@pytest.fixture(scope="module", params=["open", "admin", "key"])
def target(request: pytest.FixtureRequest) -> Target:
    if request.param == "open":
        url, headers = request.getfixturevalue("open_url"), {}
    else:
        url = request.getfixturevalue("keyed_url")
        key = ADMIN_KEY if request.param == "admin" else _user_key(url)
        headers = {"Authorization": f"Bearer {key}"}
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", timeout=REQUEST_TIMEOUT_S)
    schema.config.generation.update(max_examples=MAX_EXAMPLES, deterministic=True)
    return Target(url, schema, headers)


def _aim_at_the_model(case: Case, path: str) -> None:
    """Half the model names (body or `x-model`) become the served one of the route's task,
    so generation (or embedding) runs (a random name is a 404); a request that names none
    gets the route's model in `x-model` (two models are served: none would be a 400)."""
    model = EMBED_MODEL if path in EMBEDDING_PATHS else MODEL
    named = False
    for holder, key in ((case.body, "model"), (case.headers, "x-model")):
        if isinstance(holder, dict) and isinstance(holder.get(key), str):
            named = True
            if len(holder[key]) % 2 == 0:
                holder[key] = model
    if not named:
        case.headers = {**(case.headers or {}), "x-model": model}


def _error_shape(path: str, response: httpx.Response | Any) -> None:
    if not 400 <= response.status_code < 500:
        return
    tgi = path in TGI_ROUTES and response.status_code != 413  # the body limit's is OpenAI's
    shape = TGIErrorResponse if tgi else ErrorResponse
    if path in MESSAGES_PATHS:
        shape = AnthropicErrorResponse
    if is_ollama_path(path):
        shape = OllamaErrorResponse
    shape.model_validate(response.json())


def _strategy(schema: schemathesis.BaseSchema, label: str) -> st.SearchStrategy[Case]:
    method, path = label.split(" ", 1)
    operation = schema[path][method]
    return st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                     operation.as_strategy(GenerationMode.NEGATIVE))


@pytest.mark.parametrize("label", _operations())
def test_fuzz(target: Target, label: str) -> None:
    path = label.split(" ", 1)[1]

    @hypothesis.settings(
        max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
        phases=[Phase.explicit, Phase.generate], print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_strategy(target.schema, label))
    def run(case: Case) -> None:
        _aim_at_the_model(case, path)
        response = case.call(base_url=target.url, headers=target.headers,
                             timeout=REQUEST_TIMEOUT_S)
        case.validate_response(response, checks=CHECKS, headers=target.headers)
        _error_shape(path, response)

    run()


# Raw JSON values the fuzzer cannot send: Python's json reads NaN, Infinity, 1e999 and lone
# surrogate escapes; huge ints overflow floats and int64s.
HOSTILE = ["NaN", "-Infinity", "1e999", str(10**40), str(-(10**40)), '"\\ud800"',
           '["\\udc00"]', '{"\\ud800": 1}', "[[[[[[[[[[]]]]]]]]]]", '""', "-1", "0"]
BASES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
         "/v1/completions": {"prompt": "hi"}, "/v1/responses": {"input": "hi"},
         "/tokenize": {"prompt": "hi"},
         "/detokenize": {"tokens": [1]}, "/generate": {"inputs": "hi"},
         "/generate_stream": {"inputs": "hi"}, "/": {"inputs": "hi"},
         "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
         "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
         "/api/chat": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
         "/api/generate": {"model": MODEL, "prompt": "hi"},
         "/api/embed": {"model": EMBED_MODEL, "input": "hi"},
         "/api/embeddings": {"model": EMBED_MODEL, "prompt": "hi"},
         "/api/show": {"model": MODEL}, "/v1/embeddings": {"input": "hi"}}


def _fields(document: dict[str, Any], schema: dict[str, Any]) -> Iterator[tuple[str, ...]]:
    """The body's fields, and those of its object-valued fields (one level down)."""
    schemas = document["components"]["schemas"]
    for name, field in schema.get("properties", {}).items():
        yield (name,)
        refs = [o["$ref"] for o in field.get("anyOf", [field]) if "$ref" in o]
        for ref in refs:
            for inner in schemas[ref.rsplit("/", 1)[1]].get("properties", {}):
                yield name, inner


def _hostile_bodies(document: dict[str, Any], path: str, schema: dict[str, Any]) -> Iterator[str]:
    base = json.dumps(BASES.get(path, {}))[1:-1]
    for field in _fields(document, schema):
        for value in HOSTILE:
            for name in reversed(field[1:]):
                value = f'{{"{name}": {value}}}'
            yield f'{{{base}{", " if base else ""}"{field[0]}": {value}}}'


@pytest.mark.parametrize("setup", ["open", "admin"])
def test_hostile_json_is_a_4xx(setup: str, request: pytest.FixtureRequest) -> None:
    """Every field of every body, set to what JSON parsers disagree on: never a 5xx."""
    url = request.getfixturevalue("open_url" if setup == "open" else "keyed_url")
    headers = {"content-type": "application/json"}
    key_id = "key_none"
    if setup == "admin":
        headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        key_id = httpx.post(f"{url}/admin/keys", json={"name": "patched"}, headers=headers,
                            timeout=10).json()["id"]  # PATCHed with every hostile value
    document = httpx.get(f"{url}/openapi.json", timeout=10).json()
    schemas = document["components"]["schemas"]
    with httpx.Client(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S) as http:
        for path, item in document["paths"].items():
            for method, operation in item.items():
                if "requestBody" not in operation:
                    continue
                ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                target = path.replace("{key_id}", key_id)
                for body in _hostile_bodies(document, path, schemas[ref.rsplit("/", 1)[1]]):
                    model = EMBED_MODEL if path in EMBEDDING_PATHS else MODEL
                    response = http.request(method, target, content=body.encode(),
                                            headers={"x-model": model})
                    assert response.status_code < 500, (method, path, body, response.text)
                    _error_shape(path, response)


def test_schema_is_served(open_url: str) -> None:
    """Every JSON route documents its request body (the fuzzer needs it)."""
    document = httpx.get(f"{open_url}/openapi.json", timeout=10).json()
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if method in ("post", "patch"):
                assert "requestBody" in operation, f"{method} {path}"
            assert "x-switchyard-components" not in operation
