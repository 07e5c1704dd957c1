"""What the OpenAI-style routes answer, as documented (OpenAPI): completions, their stream
chunks, model cards, and /tokenize + /detokenize. The formatters in `responses.py`,
`logprobs.py` and `models.py` build these shapes as plain dicts; these models describe them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, RootModel

from gateway.openai.schema import Message, TokenId
from gateway.openapi import ErrorResponse

FinishReason = Literal["stop", "length", "tool_calls"]


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="A thinking model's reasoning tokens, its think "
                                              "markers included.")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache (a "
                                           "multiple of the KV block size; 0 on a miss).")


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="Only for a thinking model.")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = Field(description="The arguments, as JSON text.")


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None
    reasoning_content: str | None = Field(
        None, description="A thinking model's reasoning, without its think markers (left out "
                          "for other models and with `include_reasoning: false`).")


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class ToolCallFragment(BaseModel):
    """A piece of a streamed tool call: the first names it, later ones add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallFragment] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion; the last (with `include_usage`) has no
    choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class TextCompletion(BaseModel):
    """The answer of /v1/completions, and each event of its stream (whose last one, with
    `include_usage`, has no choices and the usage)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class ChatStreamEvent(RootModel[ChatCompletionChunk | ErrorResponse]):
    """A chunk, or the error that cut the stream short."""


class CompletionStreamEvent(RootModel[TextCompletion | ErrorResponse]):
    """A chunk, or the error that cut the stream short."""


class SamplingDefaultsCard(BaseModel):
    """What a request that omits these gets; an absent one is neutral (or the upstream's)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    alias_of: str | None = Field(None, description="The model this alias names.")
    sampling_defaults: SamplingDefaultsCard | None = Field(
        None, description="The model's sampling defaults (ours; not known while it loads).")
    task: Literal["generate", "embed"] | None = Field(
        None, description="What the model serves (ours): generate (chat, completions) or "
                          "embed (/v1/embeddings).")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """POST /tokenize: `prompt`, or `messages` (the chat template applied); not both."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
