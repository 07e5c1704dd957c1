"""The request bodies of /v1/chat/completions and /v1/completions, as documented (OpenAPI).

OpenAI's field names, types, ranges and enums, plus the vLLM extensions we accept. The
routes parse bodies with `gateway.openai.requests` (strict, OpenAI-shaped 400s); these
models only describe what that parser accepts. Checks across fields (`min_tokens` within
the token limit, one output constraint, `top_logprobs` needs `logprobs`, ...) are in the
parser alone. Unknown fields are ignored, so none of these forbid extra properties.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from gateway.openai.requests import (
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOPS,
    MAX_TOP_LOGPROBS,
)

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
NonEmpty = Annotated[str, Field(min_length=1)]
Stop = str | Annotated[list[str], Field(max_length=MAX_STOPS)]
LogitBias = Annotated[dict[str, float], WithJsonSchema({
    "type": "object", "description": "Token id (a string of digits) -> bias from -100 to 100.",
    "propertyNames": {"pattern": "^[0-9]{1,9}$"},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    "maxProperties": MAX_LOGIT_BIAS,
})]


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Doc):
    type: Literal["text"]
    text: str


Content = str | Annotated[list[TextPart], Field(min_length=1)]


class FunctionCall(_Doc):
    name: NonEmpty
    arguments: str = Field("", description="The arguments, as JSON text.")


class ToolCall(_Doc):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Doc):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Doc):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Doc):
    """`content` may be null (or left out) only when `tool_calls` is not empty."""

    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = Field(
        None, description="The answer's reasoning, for templates that render it back.")


class ToolMessage(_Doc):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage,
                    Field(discriminator="role")]


class StreamOptions(_Doc):
    include_usage: bool | None = None


class JSONSchemaFormat(_Doc):
    name: NonEmpty
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatText(_Doc):
    type: Literal["text"]


class ResponseFormatJSONObject(_Doc):
    type: Literal["json_object"]


class ResponseFormatJSONSchema(_Doc):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
    Field(discriminator="type"),
]


class StructuredOutputs(_Doc):
    """vLLM's `structured_outputs`: at most one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: NonEmpty | None = None
    grammar: NonEmpty | None = Field(None, description="A Lark grammar.")
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    json_object: bool | None = None


class _Sampling(_Doc):
    """What both endpoints share."""

    model: str | None = Field(
        None, description="A served model or alias; the `x-model` header wins over it. May be "
                          "left out when one model is served.")
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = Field(None, description="-1 or 0: off.")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: NonEmpty | None = None
    guided_grammar: NonEmpty | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    response_format: ResponseFormat | None = None


class FunctionDefinition(_Doc):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema object.")
    strict: bool | None = None


class Tool(_Doc):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Doc):
    name: str


class NamedToolChoice(_Doc):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[Literal["text"]] | None = None
    include_reasoning: bool = Field(
        True, description="A thinking model's reasoning as `reasoning_content` (false: left "
                          "out of the answer, though still generated).")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template, e.g. "
                          '{"enable_thinking": false}.')


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: NonEmpty | Annotated[list[TokenId], Field(min_length=1)] | Annotated[
        list[NonEmpty | Annotated[list[TokenId], Field(min_length=1)]],
        Field(min_length=1, max_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: Literal[False] | None = Field(False, description="Only false: not supported.")
    suffix: Literal[""] | None = Field(None, description="Not supported.")
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
