"""The Backend contract: the only thing the gateway knows about a backend.

No torch here. A backend turns one `GenerationRequest` into an async iterator of
`GenerationEvent`s; the last event carries the finish reason and usage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort", "error"]
StructuredKind = Literal["json_object", "json_schema", "regex", "lark"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, enforced token by token by a grammar engine.

    `json_object`: any JSON object (`spec` unused). `json_schema`: `spec` is the schema as
    JSON text. `regex`: `spec` is a regular expression the whole output must match. `lark`:
    `spec` is a Lark grammar. A spec the engine cannot compile is a RequestError (400).
    """

    kind: StructuredKind
    spec: str = ""
    source: str = "response_format"  # the request parameter it came from (named in errors)
    name: str | None = None  # OpenAI's json_schema `name` and `strict`, passed upstream as given
    strict: bool | None = None


# Below this temperature sampling is greedy: logits / temperature would overflow to inf and
# the probabilities to NaN (vLLM draws the line at 1e-5 too).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. A temperature below GREEDY_TEMPERATURE (0 included) means greedy;
    `top_k == 0` means off.

    `n` choices share the prompt; each choice samples with its own generator (seeded from
    `seed + index` when `seed` is set). Logprobs are always of the model's raw distribution
    (log_softmax of the logits before penalties, bias, masks or temperature).
    """

    max_tokens: int | None = None  # None: up to the context window
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # return the chosen token's logprob with each token
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    n: int = 1  # choices generated from one prompt
    top_logprobs: int = 0  # alternatives per generated token (0-20); needs `logprobs`
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many were generated
    min_p: float = 0.0  # drop tokens with probability < min_p * the top token's
    structured: StructuredOutput | None = None
    # Logprobs of the prompt's tokens (TGI's decoder_input_details), with this many
    # alternatives each; None: not computed.
    prompt_logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        """Whether each token is the argmax of the (processed) logits, drawn from no generator."""
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that omits a sampling value gets, at one level of the precedence
    (the models file, the flag, the checkpoint's generation_config). None: not set here;
    where no level sets a value, the request gets SamplingParams' neutral default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0: off
    min_p: float | None = None
    repetition_penalty: float | None = None

    def over(self, fallback: SamplingDefaults) -> SamplingDefaults:
        """These values, with `fallback`'s where these are unset."""
        unset = {f.name: getattr(fallback, f.name) for f in fields(self)
                 if getattr(self, f.name) is None}
        return replace(self, **unset)

    def report(self) -> dict[str, float | int]:
        """The values set, by name (/info, /v1/models)."""
        return {name: value for name, value in asdict(self).items() if value is not None}


NO_SAMPLING_DEFAULTS = SamplingDefaults()


@dataclass(frozen=True)
class GenerationRequest:
    """A prompt (text or chat messages) plus sampling. Exactly one of prompt/messages is set."""

    request_id: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None  # pre-tokenized prompt, overrides `prompt`
    add_generation_prompt: bool = True
    # Function tools, in OpenAI's `tools` shape, handed to the chat template.
    tools: list[dict[str, Any]] | None = None
    # Extra variables for the chat template (e.g. Qwen3's `enable_thinking`).
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Of the completion tokens, those of a thinking model's reasoning (its think markers
    # included); None for a model that does not reason.
    reasoning_tokens: int | None = None
    # Of the prompt tokens, those whose K/V came from a prefix cache (the native engine's, or
    # what an upstream reported); 0 on a miss or where the backend cannot tell.
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TopLogprob:
    """One alternative at a position: a token, its text piece and its logprob."""

    id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenInfo:
    """One token: id, its text piece, its logprob (when asked), special or not, and the
    `top_logprobs` most likely alternatives at its position (most likely first)."""

    id: int
    text: str
    logprob: float | None = None
    special: bool = False
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class RequestTimings:
    """Where a finished request spent its time inside the backend."""

    queue_seconds: float  # from arrival to its first scheduled step
    inference_seconds: float  # from its first scheduled step to its end


@dataclass(frozen=True)
class StepTiming:
    """One engine step (TGI's tgi_batch_forward_duration{method})."""

    method: Literal["prefill", "decode"]  # prefill when the step computed any prompt tokens
    seconds: float
    batch_size: int


@dataclass(frozen=True)
class ReasoningSplit:
    """An event's text of a thinking model, split: its reasoning and its answer (`content`),
    the think markers dropped."""

    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True)
class GenerationEvent:
    """A text delta of choice `index`.

    Each choice's last event has `finish_reason` and `usage` set (the prompt's tokens and
    that choice's completion tokens); with `n > 1` the choices' events interleave and the
    iterator ends once every choice has finished.
    """

    text: str = ""
    tokens: tuple[TokenInfo, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    # Which stop ended the request: "eos_token" or "stop_sequence" (TGI's details), if any.
    stop_reason: str | None = None
    # The stop string that ended the choice, where the backend knows it (with "stop_sequence").
    stop_sequence: str | None = None
    timings: RequestTimings | None = None  # on the last event
    seed: int | None = None  # the seed sampling used (TGI's details.seed), on the last event
    index: int = 0  # the choice this event belongs to (0 .. n-1)
    # The prompt's tokens with their logprobs (the first has none), when
    # `prompt_logprobs` was asked; on the first event of choice 0.
    prompt_tokens: tuple[TokenInfo, ...] | None = None
    # A thinking model's `text` split into reasoning and content (None: the model does not
    # reason, `text` is all content). `text` stays the text as generated, markers included.
    split: ReasoningSplit | None = None


@dataclass(frozen=True)
class LoadStage:
    """One stage of loading a model ("weights", "kv cache", "warm-up compile", ...)."""

    name: str
    seconds: float | None = None  # how long it took, once finished
    cached: bool = False  # served from the startup cache
    progress: float | None = None  # 0..1 while running, where the stage can tell
    detail: str = ""

    def report(self) -> dict[str, Any]:
        return {"name": self.name, "seconds": self.seconds, "cached": self.cached,
                "progress": self.progress, "detail": self.detail}


@dataclass(frozen=True)
class LoadReport:
    """Where a model's load stands: the stage running now (None between stages and once
    loaded) and the finished ones with their timings."""

    current: LoadStage | None
    finished: tuple[LoadStage, ...] = ()
    seconds: float = 0.0  # since loading began

    def report(self) -> dict[str, Any]:
        return {"stage": self.current.report() if self.current else None,
                "stages": [s.report() for s in self.finished],
                "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class Health:
    ready: bool
    detail: str = ""
    load: LoadReport | None = None  # a backend that loads a model: its load stages


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_input_tokens: int
    max_total_tokens: int
    dtype: str = "unknown"
    quantization: str | None = None
    backend: str = "unknown"
    chat_template: str | None = None  # the tokenizer's, when the backend templates itself
    extra: dict[str, Any] = field(default_factory=dict)
    # The checkpoint's own (its generation_config); the gateway's configured ones go over them.
    sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS


@dataclass(frozen=True)
class BackendStats:
    """Gauges the gateway exports on /metrics (zeros where a backend has no such thing)."""

    queue_size: int = 0
    running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    batch_max_tokens: int = 0  # tokens the running batch may grow to (prompt + max new)
    batch_next_size: int = 0  # sequences that joined the batch in the last step
    prefix_cache_queries: int = 0  # cumulative prompt blocks looked up
    prefix_cache_hits: int = 0  # cumulative prompt blocks found cached
    preemptions: int = 0  # cumulative
    # Cumulative: requests refused with 429 for a full queue (--max-queued-requests /
    # --max-queued-tokens), requests ended by --queue-timeout / --request-timeout, engine
    # steps that raised, and requests failed by an engine error.
    queue_rejections_requests: int = 0
    queue_rejections_tokens: int = 0
    queue_timeouts: int = 0
    request_timeouts: int = 0
    step_failures: int = 0
    failed_requests: int = 0
    # Cumulative tokens routed to each expert of a mixture-of-experts model, summed over its MoE
    # layers (empty for a dense model): an uneven spread is expert imbalance.
    expert_tokens: tuple[int, ...] = ()


class RequestError(Exception):
    """A client mistake found by the backend (e.g. prompt too long): becomes a 4xx; also a
    refusal that is nobody's mistake (429 overloaded, 503 queue timeout, 504 request timeout).

    Raised by the generate() iterator before its first event; after it only by an HTTP
    backend whose upstream's stream ends with an error event that blames the request.
    """

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None,
        status_code: int = 400, error_type: str = "invalid_request_error",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status_code = status_code
        self.error_type = error_type
        self.retry_after = retry_after  # seconds a 429 / 503 suggests waiting (Retry-After)


class BackendUnavailable(Exception):
    """The backend cannot take requests now (loading, dead, overloaded upstream): 503."""


class DeploymentError(Exception):
    """One deployment failed a request: connect error, timeout, a 5xx or 429 from an upstream,
    a malformed upstream answer. Raised by generate()'s iterator, before its first event or
    after. Before the first event routing may move the request to another deployment (it
    counts the failure toward that deployment's cooldown); after it, the gateway ends the
    response with an error (a 502 / 504 answer, or an error event in a stream).
    """

    def __init__(
        self, message: str, *, status_code: int = 502, code: str = "upstream_error",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code  # 502 bad upstream answer, 504 timeout, 429, 503
        self.code = code
        self.retry_after = retry_after


@runtime_checkable
class Backend(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]: ...

    async def health(self) -> Health: ...

    def info(self) -> ModelInfo: ...

    def stats(self) -> BackendStats: ...

    def drain_step_timings(self) -> list[StepTiming]:
        """Step timings recorded since the last call (for histograms)."""
        ...

    def count_tokens(self, req: GenerationRequest) -> int:
        """Prompt tokens of `req` after templating (for validation and limits)."""
        ...

    def tokenize(self, req: GenerationRequest) -> list[int]:
        """The prompt token ids of `req` after templating (e.g. for TGI's `truncate`)."""
        ...

    def detokenize(self, token_ids: list[int]) -> str:
        """Text of `token_ids` (vLLM's /detokenize). RequestError when an id is outside the
        vocabulary or the backend has no tokenizer."""
        ...
