"""TGI's `/generate` request: its schema, its validation (TGI's own messages), and the plan
that turns it into a `GenerationRequest`.

Faithful to TGI's router: a missing `parameters` object means `do_sample: true`; a request
samples when `do_sample` is set or a sampling parameter implies it (temperature != 1,
top_k, top_p), else it is greedy whatever else it carries; `max_new_tokens` defaults to
100; `stop` allows 4 strings. What the engine cannot do (typical_p, watermark, grammar,
best_of > 1, top_n_tokens, decoder_input_details, adapters) is refused, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from backends.base import ModelInfo, SamplingParams

MAX_STOP_SEQUENCES = 4
MAX_BEST_OF = 1
MAX_TOP_N_TOKENS = 0
DEFAULT_MAX_NEW_TOKENS = 100
_U32 = 2**32 - 1
_U64 = 2**64 - 1


class TGIValidationError(Exception):
    """A request TGI would refuse: 422 `{"error": message, "error_type": "validation"}`."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TGIParameters(BaseModel):
    """TGI's `GenerateParameters`, with its types (f32 accepts 1, u32 refuses 1.0 and -1)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    do_sample: bool = False
    max_new_tokens: int | None = Field(DEFAULT_MAX_NEW_TOKENS, ge=0, le=_U32)
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    temperature: float | None = None
    top_k: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
    top_p: float | None = None
    typical_p: float | None = None
    truncate: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, le=_U64)
    stop: list[str] = Field(default_factory=list)
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool | None = None
    best_of: int | None = Field(None, ge=0)
    watermark: bool = False
    top_n_tokens: int | None = Field(None, ge=0, le=_U32)
    grammar: dict[str, Any] | None = None
    adapter_id: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _no_stops(cls, value: Any) -> Any:
        return [] if value is None else value


class TGIRequest(BaseModel):
    """TGI's `GenerateRequest` (`stream` is read by `POST /` only)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    inputs: str
    parameters: TGIParameters = Field(default_factory=lambda: TGIParameters(do_sample=True))
    stream: bool = False

    @field_validator("parameters", mode="before")
    @classmethod
    def _absent_parameters(cls, value: Any) -> Any:
        return {"do_sample": True} if value is None else value


def parse_request(data: Any) -> TGIRequest:
    if not isinstance(data, dict):
        raise TGIValidationError("Failed to deserialize the JSON body: expected a JSON object")
    try:
        return TGIRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise TGIValidationError(
            f"Failed to deserialize the JSON body into the target type: {where}: {first['msg']}"
        ) from None


@dataclass(frozen=True)
class TGIPlan:
    """What a valid request asks for, beyond the prompt."""

    sampling: SamplingParams
    details: bool
    return_full_text: bool
    truncate: int | None


def _check_unsupported(p: TGIParameters, stream: bool) -> None:
    if p.best_of is not None and not 0 < p.best_of <= MAX_BEST_OF:
        raise TGIValidationError(f"`best_of` must be > 0 and <= {MAX_BEST_OF}. Given: {p.best_of}")
    if p.decoder_input_details:
        raise TGIValidationError(
            "`decoder_input_details` == true is not supported when streaming tokens" if stream
            else "`decoder_input_details` == true is not supported by this server "
                 "(prompt token logprobs are not computed)")
    if p.top_n_tokens:
        raise TGIValidationError(
            f"`top_n_tokens` must be >= 0 and <= {MAX_TOP_N_TOKENS}. Given: {p.top_n_tokens}")
    if p.watermark:
        raise TGIValidationError("`watermark` is not supported by this server")
    if p.grammar is not None:
        raise TGIValidationError("grammar is not supported")
    if p.adapter_id:
        raise TGIValidationError("`adapter_id` is not supported by this server (no adapters)")


def _check_ranges(p: TGIParameters) -> None:
    if p.temperature is not None and p.temperature <= 0:
        raise TGIValidationError("`temperature` must be strictly positive")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0:
        raise TGIValidationError("`repetition_penalty` must be strictly positive")
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        raise TGIValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise TGIValidationError("`top_p` must be > 0.0 and < 1.0")
    if p.typical_p is not None:
        if not 0.0 < p.typical_p < 1.0:
            raise TGIValidationError("`typical_p` must be > 0.0 and < 1.0")
        raise TGIValidationError(
            "`typical_p` is not supported by this server (its engine has no typical decoding)")
    if p.top_k is not None and p.top_k <= 0:
        raise TGIValidationError("`top_k` must be strictly positive")
    if p.max_new_tokens == 0:
        raise TGIValidationError("`max_new_tokens` must be strictly positive")
    if len(p.stop) > MAX_STOP_SEQUENCES:
        raise TGIValidationError(
            f"`stop` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(p.stop)}")


def samples(p: TGIParameters) -> bool:
    """TGI samples when asked to, or when a warper is set (temperature != 1, top_k, top_p)."""
    warped = (p.temperature is not None and p.temperature != 1.0) or p.top_k is not None \
        or p.top_p is not None
    return p.do_sample or warped


def _sampling(p: TGIParameters, logprobs: bool) -> SamplingParams:
    shared: dict[str, Any] = {
        "max_tokens": p.max_new_tokens, "stop": tuple(p.stop), "logprobs": logprobs,
        "repetition_penalty": 1.0 if p.repetition_penalty is None else p.repetition_penalty,
        "frequency_penalty": p.frequency_penalty or 0.0,
    }
    if not samples(p):
        return SamplingParams(temperature=0.0, **shared)
    return SamplingParams(
        temperature=1.0 if p.temperature is None else p.temperature,
        top_p=1.0 if p.top_p is None else p.top_p, top_k=p.top_k or 0, seed=p.seed, **shared,
    )


def plan(body: TGIRequest, *, stream: bool, full_text_default: bool = False) -> TGIPlan:
    """TGI's checks that need no tokenizer, in TGI's order.

    `return_full_text` defaults to false, except on `POST /` where TGI defaults it to true
    for text-generation models (all of ours).
    """
    p = body.parameters
    _check_unsupported(p, stream)
    _check_ranges(p)
    if not body.inputs:
        raise TGIValidationError("`inputs` cannot be empty")
    # Stream tokens always carry their logprob in TGI; details list them.
    return TGIPlan(
        sampling=_sampling(p, logprobs=stream or p.details), details=p.details,
        return_full_text=full_text_default if p.return_full_text is None else p.return_full_text,
        truncate=p.truncate,
    )


def check_truncate(truncate: int | None, info: ModelInfo) -> None:
    if truncate is not None and not 0 < truncate <= info.max_input_tokens:
        raise TGIValidationError(
            f"`truncate` must be strictly positive and less than {info.max_input_tokens}. "
            f"Given: {truncate}")


def check_length(input_tokens: int, max_new_tokens: int | None, info: ModelInfo) -> None:
    """TGI's two length checks, total first (the one its users know by heart)."""
    max_total = info.max_total_tokens
    new = max(max_total - input_tokens, 0) if max_new_tokens is None else max_new_tokens
    if input_tokens + new > max_total:
        raise TGIValidationError(
            f"`inputs` tokens + `max_new_tokens` must be <= {max_total}. "
            f"Given: {input_tokens} `inputs` tokens and {new} `max_new_tokens`")
    if input_tokens > info.max_input_tokens:
        raise TGIValidationError(
            f"`inputs` must have less than {info.max_input_tokens} tokens. "
            f"Given: {input_tokens}")
