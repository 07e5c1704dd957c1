"""TGI's `/generate` request: its schema, its validation (TGI's own messages), and the plan
that turns it into a `GenerationRequest`.

Faithful to TGI's router: a missing `parameters` object means `do_sample: true`; a request
samples when `do_sample` is set or a sampling parameter implies it (temperature != 1,
top_k, top_p), else it is greedy whatever else it carries; `max_new_tokens` defaults to
100; `stop` allows --max-stop-sequences strings (4, checked in gateway/limits.py);
`top_n_tokens` up to 5; `best_of` (sampled `n` choices, the
one with the highest logprob sum answers) up to 4, never streamed, never with a `seed`;
`decoder_input_details` (the prompt's logprobs) never streamed. What the engine cannot do
(typical_p, watermark, adapters) is refused, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from backends.base import ModelInfo, SamplingParams, StructuredOutput
from gateway.tgi.grammar import GrammarShapeError, parse_grammar

MAX_STOP_SEQUENCES = 4  # the default of --max-stop-sequences (gateway/limits.py checks it)
MAX_BEST_OF = 4
MAX_TOP_N_TOKENS = 5
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
    grammar: Any = None  # checked by `parse_grammar`, with TGI's messages
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
    details: bool  # TGI answers details when `details` or `decoder_input_details` is set
    return_full_text: bool
    truncate: int | None
    top_n_tokens: int = 0
    prefill: bool = False  # decoder_input_details


def _check_stream(p: TGIParameters, stream: bool) -> None:
    """What TGI's /generate_stream refuses before anything else."""
    if not stream:
        return
    if p.best_of is not None and p.best_of != 1:
        raise TGIValidationError("`best_of` != 1 is not supported when streaming tokens")
    if p.decoder_input_details:
        raise TGIValidationError(
            "`decoder_input_details` == true is not supported when streaming tokens")


def _check_best_of(p: TGIParameters) -> None:
    if p.best_of is not None and not 0 < p.best_of <= MAX_BEST_OF:
        raise TGIValidationError(f"`best_of` must be > 0 and <= {MAX_BEST_OF}. Given: {p.best_of}")
    # TGI's test: any sampling parameter present (even temperature 1.0, which stays greedy).
    asked = p.do_sample or any(
        v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))
    if (p.best_of or 1) > 1 and not asked:
        raise TGIValidationError("you must use sampling when `best_of` is > 1")


def _check_unsupported(p: TGIParameters) -> None:
    if p.watermark:
        raise TGIValidationError("`watermark` is not supported by this server")
    if p.adapter_id:
        raise TGIValidationError("`adapter_id` is not supported by this server (no adapters)")


def _check_choices(p: TGIParameters) -> None:
    """TGI's checks after the ranges: a seed cannot seed several choices; top_n_tokens."""
    if p.seed is not None and (p.best_of or 1) > 1:
        raise TGIValidationError("`seed` must not be set when `best_of` > 1")
    if p.top_n_tokens is not None and p.top_n_tokens > MAX_TOP_N_TOKENS:
        raise TGIValidationError(
            f"`top_n_tokens` must be >= 0 and <= {MAX_TOP_N_TOKENS}. Given: {p.top_n_tokens}")


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


def samples(p: TGIParameters) -> bool:
    """TGI samples when asked to, or when a warper is set (temperature != 1, top_k, top_p)."""
    warped = (p.temperature is not None and p.temperature != 1.0) or p.top_k is not None \
        or p.top_p is not None
    return p.do_sample or warped


def _grammar(p: TGIParameters) -> StructuredOutput | None:
    if p.grammar is None:
        return None
    try:
        return parse_grammar(p.grammar)
    except GrammarShapeError as exc:
        raise TGIValidationError(exc.message) from None


def _sampling(p: TGIParameters, logprobs: bool) -> SamplingParams:
    top_n = p.top_n_tokens or 0
    best_of = p.best_of or 1
    shared: dict[str, Any] = {
        "max_tokens": p.max_new_tokens, "stop": tuple(p.stop),
        # best_of ranks its choices by their logprob sum; top_n_tokens are logprobs too.
        "logprobs": logprobs or top_n > 0 or best_of > 1, "top_logprobs": top_n,
        "prompt_logprobs": top_n if p.decoder_input_details else None,
        "repetition_penalty": 1.0 if p.repetition_penalty is None else p.repetition_penalty,
        "frequency_penalty": p.frequency_penalty or 0.0,
        "n": best_of, "structured": _grammar(p),
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
    _check_stream(p, stream)
    _check_best_of(p)
    _check_ranges(p)
    _check_choices(p)
    _check_unsupported(p)
    if not body.inputs:
        raise TGIValidationError("`inputs` cannot be empty")
    details = p.details or p.decoder_input_details
    # Stream tokens always carry their logprob in TGI; details list them.
    return TGIPlan(
        sampling=_sampling(p, logprobs=stream or details), details=details,
        return_full_text=full_text_default if p.return_full_text is None else p.return_full_text,
        truncate=p.truncate, top_n_tokens=p.top_n_tokens or 0,
        prefill=p.decoder_input_details,
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
