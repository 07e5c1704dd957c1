"""Ollama's API bodies: the requests (parsed strictly, and documented from the same models)
and the answers (documented; answer.py and catalog.py build them as dicts).

Strict types as Ollama's Go server has them (no "1" for 1, no 1.5 for an integer); unknown
fields are ignored, as Ollama ignores them. Ranges of `options` are the chat completion's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.openai.messages import invalid

_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class OllamaOptions(_Strict):
    """The sampling options the engine applies. Others (num_ctx, num_thread, mirostat, ...)
    are ignored, as Ollama ignores options it does not know; what is left out comes from
    the model's sampling defaults."""

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off.")
    min_p: float | None = Field(None, ge=0, le=1)
    num_predict: int | None = Field(None, ge=-2, description=(
        "The most tokens to generate; -1, -2 or 0: up to the context window (and the "
        "server's --max-output-tokens)."))
    stop: list[str] | None = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    repeat_penalty: float | None = Field(None, gt=0, le=10)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)


Format = Literal["", "json"] | dict[str, Any]
Think = bool | Literal["high", "medium", "low"]
_KEEP_ALIVE = Field(None, description="Accepted and ignored: served models stay loaded.")


def _checked_format(value: Any) -> Any:
    if value is None or value in ("", "json") or isinstance(value, dict):
        return value
    raise invalid("format must be 'json' or a JSON Schema object")


def _checked_think(value: Any) -> Any:
    if value is None or isinstance(value, bool) or value in ("high", "medium", "low"):
        return value
    raise invalid("think must be true, false, or one of 'high', 'medium', 'low'")


class _Generating(_Strict):
    """What /api/chat and /api/generate share."""

    model: str = Field(min_length=1)
    format: Format | None = Field(None, description=(
        "'json', or a JSON Schema the answer must match."))
    options: OllamaOptions | None = None
    stream: bool = Field(True, description=(
        "Newline-delimited JSON objects (application/x-ndjson), the last with done: true; "
        "false: one object."))
    think: Think | None = Field(None, description=(
        "A thinking model's reasoning: false turns it off; true, a level (accepted, not "
        "applied) or left out: on, answered apart as `thinking`."))
    keep_alive: str | float | None = _KEEP_ALIVE

    @field_validator("format", mode="before")
    @classmethod
    def _format(cls, value: Any) -> Any:
        return _checked_format(value)

    @field_validator("think", mode="before")
    @classmethod
    def _think(cls, value: Any) -> Any:
        return _checked_think(value)


class OllamaFunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None


class OllamaToolCall(_Strict):
    function: OllamaFunctionCall
    id: str | None = Field(None, description="Ours: the call's id, as tool messages name it.")


class OllamaMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = Field(None, description="Refused: no vision model is served.")
    thinking: str | None = Field(None, description="An earlier answer's reasoning.")
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = Field(None, description="The tool a tool message answers.")
    tool_call_id: str | None = Field(None, description="The call a tool message answers.")


class OllamaChatRequest(_Generating):
    messages: list[OllamaMessage] = Field(default_factory=list, description=(
        "The conversation; none: the model is only checked (done_reason 'load')."))
    tools: list[dict[str, Any]] | None = None
    logprobs: bool | None = Field(None, description="Not supported (use /v1/chat/completions).")


class OllamaGenerateRequest(_Generating):
    prompt: str = Field("", description="Empty: the model is only checked "
                                        "(done_reason 'load').")
    system: str | None = None
    raw: bool = Field(False, description="The prompt as is, without the chat template.")
    suffix: str | None = Field(None, description="Refused: no fill-in-the-middle here.")
    template: str | None = Field(None, description="Refused: the model's own chat template "
                                                   "is used; `raw` skips it.")
    context: list[int] | None = Field(None, description=(
        "Refused when not empty: no context tokens are answered; send the conversation to "
        "/api/chat."))
    images: list[str] | None = Field(None, description="Refused: no vision model is served.")
    logprobs: bool | None = Field(None, description="Not supported (use /v1/completions).")


class OllamaEmbedRequest(_Strict):
    model: str = Field(min_length=1)
    input: str | list[str] = Field("", description=(
        "A text or a list of texts (at most --max-embedding-inputs); none loads the model."))
    truncate: bool | None = Field(None, description=(
        "true (the default): an input longer than the model takes is cut to fit; false: a 400."))
    options: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    keep_alive: str | float | None = _KEEP_ALIVE
    dimensions: int | None = Field(None, ge=1, description=(
        "Keep the first N values and renormalise (models that normalise their vectors)."))


class OllamaEmbeddingsRequest(_Strict):
    """The older /api/embeddings: one prompt, cut to fit when too long."""

    model: str = Field(min_length=1)
    prompt: str = Field("", description="The text; none loads the model.")
    options: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    keep_alive: str | float | None = _KEEP_ALIVE


class OllamaShowRequest(_Strict):
    model: str | None = Field(None, min_length=1)
    name: str | None = Field(None, min_length=1, description="The older name of `model`.")
    verbose: bool | None = None


# ---- answers (documentation) ------------------------------------------------------------

DoneReason = Literal["stop", "length", "load"]


class OllamaDone(BaseModel):
    """The last object of an answer (with done: true) also has these."""

    done_reason: DoneReason | None = None
    total_duration: int | None = Field(None, description="Nanoseconds, as all durations.")
    load_duration: int | None = Field(None, description="0: models stay loaded.")
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = Field(None, description="Until the first token.")
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaToolCallOut(BaseModel):
    id: str
    function: OllamaFunctionCall


class OllamaMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str
    thinking: str | None = None
    tool_calls: list[OllamaToolCallOut] | None = None


class OllamaChatResponse(OllamaDone):
    """A chat answer, or one object of its stream (a fragment of the message)."""

    model: str
    created_at: str
    message: OllamaMessageOut
    done: bool


class OllamaGenerateResponse(OllamaDone):
    model: str
    created_at: str
    response: str
    thinking: str | None = None
    done: bool


class OllamaDetails(BaseModel):
    parent_model: str
    format: str
    family: str
    families: list[str] | None
    parameter_size: str
    quantization_level: str


class OllamaModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaDetails
    capabilities: list[str] | None = Field(None, description=(
        '["embedding"] for an embedding model, else completion and tools (and thinking).'))


class OllamaTags(BaseModel):
    models: list[OllamaModel]


class OllamaRunningModel(OllamaModel):
    expires_at: str
    size_vram: int
    context_length: int


class OllamaRunning(BaseModel):
    models: list[OllamaRunningModel]


class OllamaShow(BaseModel):
    modified_at: str
    details: OllamaDetails
    model_info: dict[str, Any]
    template: str
    parameters: str
    capabilities: list[str]


class OllamaVersion(BaseModel):
    version: str


class OllamaEmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int | None = Field(None, description="Nanoseconds.")
    load_duration: int | None = Field(None, description="0: models stay loaded.")
    prompt_eval_count: int | None = Field(None, description="The inputs' tokens, summed.")


class OllamaEmbeddingsResponse(BaseModel):
    embedding: list[float]


class OllamaErrorResponse(BaseModel):
    """Ollama's error body, on its routes (its client raises ResponseError with it)."""

    error: str
