"""TGI's API as documented (OpenAPI): `GenerateRequest`, its answers and `/info`, with TGI's
names and ranges. The routes parse bodies with `gateway.tgi.requests` (TGI's own checks and
messages); these models only describe what it accepts and what the routes answer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from gateway.openapi import TGIErrorResponse
from gateway.tgi.requests import MAX_BEST_OF, MAX_STOP_SEQUENCES, MAX_TOP_N_TOKENS

U32 = 2**32 - 1
Positive = Annotated[float, Field(gt=0)]
FinishReason = Literal["length", "eos_token", "stop_sequence"]


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class JSONGrammar(_Doc):
    type: Literal["json", "json_object"]
    value: dict[str, Any] | str = Field(description="A JSON schema (or its text).")


class RegexGrammar(_Doc):
    type: Literal["regex"]
    value: str


Grammar = Annotated[JSONGrammar | RegexGrammar, Field(discriminator="type")]


class GenerateParameters(_Doc):
    do_sample: bool = False
    max_new_tokens: Annotated[int, Field(ge=1, le=U32)] | None = 100
    repetition_penalty: Positive | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    temperature: Positive | None = None
    top_k: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    top_p: Annotated[float, Field(gt=0, lt=1)] | None = None
    truncate: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Keep only the last `truncate` input tokens (at most max_input_tokens).")
    seed: Annotated[int, Field(ge=0, le=2**64 - 1)] | None = Field(
        None, description="Not with best_of > 1.")
    stop: Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    details: bool = False
    decoder_input_details: bool = Field(False, description="Not when streaming.")
    return_full_text: bool | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_BEST_OF)] | None = Field(
        None, description="Needs sampling when > 1; not when streaming.")
    watermark: Literal[False] = Field(False, description="Not supported.")
    top_n_tokens: Annotated[int, Field(ge=0, le=MAX_TOP_N_TOKENS)] | None = None
    grammar: Grammar | None = None


class GenerateRequest(_Doc):
    """POST /generate and /generate_stream (`x-model` header chooses among several models)."""

    inputs: Annotated[str, Field(min_length=1)]
    parameters: GenerateParameters | None = Field(
        None, description="Left out: TGI's defaults with do_sample true.")


class CompatGenerateRequest(GenerateRequest):
    """POST /: streams when `stream` is true."""

    stream: bool = False


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


class BestOfSequence(BaseModel):
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None


class Details(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None
    best_of_sequences: list[BestOfSequence] | None = None


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class CompatGenerateResponse(RootModel[list[GenerateResponse]]):
    """POST / without streaming: a list of one answer."""


class StreamDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    input_length: int


class StreamResponse(BaseModel):
    """One token; the last event also has `generated_text` (and `details` when asked)."""

    index: int
    token: Token
    top_tokens: list[Token]
    generated_text: str | None
    details: StreamDetails | None


class TGIStreamEvent(RootModel[StreamResponse | TGIErrorResponse]):
    """A token, or the error that cut the stream short."""


class Info(BaseModel):
    """GET /info: TGI's fields (the engine's knobs are null where a backend has none)."""

    model_config = ConfigDict(extra="allow")

    model_id: str
    model_sha: str | None
    model_dtype: str
    model_device_type: str | None
    model_pipeline_tag: str | None
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    max_client_batch_size: int
    max_concurrent_requests: int | None
    max_batch_total_tokens: int | None
    max_batch_prefill_tokens: int | None
    max_batch_size: int | None
    max_waiting_tokens: int | None
    waiting_served_ratio: float | None
    router: str
    version: str
    sha: str | None
    docker_label: str | None
