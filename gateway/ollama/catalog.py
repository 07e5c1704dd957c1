"""Ollama's model routes: GET /api/tags (the served models), POST /api/show (one of them),
GET /api/ps (those loaded), GET /api/version, and `GET /` / `HEAD /` ("Ollama is running",
which clients probe).

Models are listed as Ollama names them, `name:latest` (a served name with a tag of its own
as it is), with their aliases, and only those the caller's key may use. What Ollama reads
from a model file comes from the backend's model info here: the architecture as the family,
the parameter count, the quantization (or the dtype, as F32 / BF16 / F16), the weights'
bytes as the size; a remote model tells none of it, and answers with empty details. The
digest is a stable hash of the served name and checkpoint, not of the weights' bytes;
there is no Modelfile, so /api/show answers its model's details, chat template, sampling
defaults as `parameters`, and capabilities: `["embedding"]` for an embedding model (task
`embed`), else completion and tools (and thinking); /api/tags and /api/ps list each model's
capabilities too, so a client can tell an embedding model from the listing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from backends.base import ModelInfo
from gateway.body import parse_body, read_json
from gateway.errors import bad_request
from gateway.guard import GUARD, principal_of
from gateway.ollama import schema
from gateway.ollama.translate import LATEST, served_model
from gateway.openapi import Answer, documented
from gateway.sampling_defaults import effective, model_info
from gateway.state import gateway_state
from routing.registry import ModelEntry

OLLAMA_VERSION = "0.9.0"  # the Ollama release whose API this mirrors (thinking, tools, format)
RUNNING = "Ollama is running"
NEVER = "2318-01-01T00:00:00Z"  # a loaded model's expires_at: served models stay loaded
_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_PARAMETER_NAMES = {"repetition_penalty": "repeat_penalty"}
JSON = dict[str, Any]

router = APIRouter(dependencies=[GUARD])
open_router = APIRouter()


@dataclass(frozen=True)
class Facts:
    """What a model's info tells of it, in Ollama's terms ("" or 0: not known)."""

    format: str = ""
    family: str = ""
    parameters: int = 0
    quantization: str = ""
    size: int = 0
    on_gpu: bool = False
    context_length: int = 0
    thinking: bool = False

    @classmethod
    def of(cls, info: ModelInfo | None) -> Facts:
        if info is None:  # loading, or its backend cannot say now
            return cls()
        extra = info.extra
        gguf = bool(extra.get("gguf_formats")) or str(extra.get("model_id", "")).endswith(".gguf")
        return cls(
            format="gguf" if gguf else ("safetensors" if info.backend == "native" else ""),
            family=str(extra.get("architecture") or ""),
            parameters=int(extra.get("parameter_count") or 0),
            quantization=info.quantization or (
                _DTYPES.get(info.dtype, "") if info.backend == "native" else ""),
            size=int(extra.get("weight_bytes") or 0), on_gpu=extra.get("device") == "cuda",
            context_length=info.max_total_tokens, thinking=bool(extra.get("thinking")))

    def details(self) -> JSON:
        return {"parent_model": "", "format": self.format, "family": self.family,
                "families": [self.family] if self.family else None,
                "parameter_size": human_count(self.parameters) if self.parameters else "",
                "quantization_level": self.quantization}


def human_count(count: int) -> str:
    """Ollama's way: 7.6B, 494.03M, 135M."""
    for unit, size, places in (("B", 10**9, 1), ("M", 10**6, 2), ("K", 10**3, 2)):
        if count >= size:
            text = f"{count / size:.{places}f}".rstrip("0").rstrip(".")
            return f"{text}{unit}"
    return str(count)


def tagged(name: str) -> str:
    return name if ":" in name.rsplit("/", 1)[-1] else name + LATEST


def _stamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _digest(entry: ModelEntry, info: ModelInfo | None) -> str:
    checkpoint = str(info.extra.get("model_id", "")) if info is not None else ""
    return hashlib.sha256(f"{entry.name}\n{checkpoint}".encode()).hexdigest()


def capabilities(entry: ModelEntry, facts: Facts) -> list[str]:
    if entry.router.task == "embed":
        return ["embedding"]
    return ["completion", "tools", *(["thinking"] if facts.thinking else [])]


def _card(entry: ModelEntry, name: str, info: ModelInfo | None) -> JSON:
    facts = Facts.of(info)
    return {"name": tagged(name), "model": tagged(name), "modified_at": _stamp(entry.created),
            "size": facts.size, "digest": _digest(entry, info), "details": facts.details(),
            "capabilities": capabilities(entry, facts)}


def _usable(request: Request) -> list[ModelEntry]:
    principal = principal_of(request)
    return [e for e in gateway_state(request).models.models() if principal.may_use(e.name)]


@router.get("/api/tags", **documented(
    Answer(200, "The models (and aliases) the caller may use.", model=schema.OllamaTags),
    errors=(401, 503), error=schema.OllamaErrorResponse))
async def tags(request: Request) -> JSONResponse:
    cards = []
    for entry in _usable(request):
        info = await model_info(entry)
        cards.extend(_card(entry, name, info) for name in (entry.name, *entry.aliases))
    return JSONResponse({"models": cards})


@router.get("/api/ps", **documented(
    Answer(200, "The loaded models the caller may use.", model=schema.OllamaRunning),
    errors=(401, 503), error=schema.OllamaErrorResponse))
async def running(request: Request) -> JSONResponse:
    models = []
    for entry in _usable(request):
        info = await model_info(entry)
        if info is None:  # not loaded (yet)
            continue
        facts = Facts.of(info)
        models.append({**_card(entry, entry.name, info), "expires_at": NEVER,
                       "size_vram": facts.size if facts.on_gpu else 0,
                       "context_length": facts.context_length})
    return JSONResponse({"models": models})


def _parameters(entry: ModelEntry, info: ModelInfo | None) -> str:
    values = effective(entry, info).report()
    return "\n".join(f"{_PARAMETER_NAMES.get(name, name)} {value}"
                     for name, value in values.items())


@router.post("/api/show", **documented(
    Answer(200, "The model's details, chat template, sampling defaults and capabilities.",
           model=schema.OllamaShow),
    body=schema.OllamaShowRequest, errors=(400, 401, 403, 404, 413, 503),
    error=schema.OllamaErrorResponse))
async def show(request: Request) -> JSONResponse:
    body = parse_body(await read_json(request), schema.OllamaShowRequest)
    name = body.model or body.name
    if name is None:
        raise bad_request("model is required", "model", "missing_required_parameter")
    state = gateway_state(request)
    entry = served_model(state, request, name)
    await state.access.authorize(principal_of(request), entry.name)
    info = await model_info(entry)
    facts = Facts.of(info)
    model_info_: JSON = {}
    if facts.family:
        model_info_["general.architecture"] = facts.family
        model_info_[f"{facts.family}.context_length"] = facts.context_length
    if facts.parameters:
        model_info_["general.parameter_count"] = facts.parameters
    return JSONResponse({
        "modified_at": _stamp(entry.created), "details": facts.details(),
        "model_info": model_info_, "template": (info.chat_template if info else None) or "",
        "parameters": _parameters(entry, info),
        "capabilities": capabilities(entry, facts)})


@open_router.get("/api/version", **documented(
    Answer(200, "The Ollama version whose API this server mirrors.", model=schema.OllamaVersion),
    errors=(), secured=False))
async def version() -> JSONResponse:
    return JSONResponse({"version": OLLAMA_VERSION})


_RUNNING_DOCS = documented(Answer(200, "The text Ollama's clients probe for.", text="text/plain"),
                           errors=(), secured=False)


@open_router.get("/", operation_id="ollama_running", **_RUNNING_DOCS)
@open_router.head("/", operation_id="ollama_running_head", **_RUNNING_DOCS)
async def root() -> Response:
    return PlainTextResponse(RUNNING)
