"""The Responses API's bodies and answers, as documented (OpenAPI).

The route parses bodies with `request.py` and `items.py` (strict, OpenAI-shaped 400s); these
models only describe what that parser accepts and what the routes answer. Names carry a
`Resp` prefix: the document's components share one namespace with the chat route's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from gateway.responses_api.request import MAX_METADATA

NonEmpty = Annotated[str, Field(min_length=1)]
Status = Literal["in_progress", "completed", "incomplete"]


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- request ------------------------------------------------------------------------------


class RespInputText(_Doc):
    type: Literal["input_text", "output_text"]
    text: str


TextParts = Annotated[list[RespInputText], Field(min_length=1)]


class RespInputMessage(_Doc):
    """A message; `type` may be left out."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | TextParts
    id: NonEmpty | None = None
    status: Status | None = None


class RespInputFunctionCall(_Doc):
    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: str = Field(description="The arguments, as JSON text.")
    id: NonEmpty | None = None
    status: Status | None = None


class RespInputFunctionOutput(_Doc):
    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: str | TextParts
    id: NonEmpty | None = None


class RespReasoningText(_Doc):
    type: Literal["reasoning_text"]
    text: str


class RespSummaryText(_Doc):
    type: Literal["summary_text"]
    text: str


class RespInputReasoning(_Doc):
    type: Literal["reasoning"]
    id: NonEmpty | None = None
    summary: list[RespSummaryText] | None = None
    content: list[RespReasoningText] | None = None


InputItem = RespInputMessage | RespInputFunctionCall | RespInputFunctionOutput | RespInputReasoning


class RespFunctionTool(_Doc):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema object.")
    strict: bool | None = None


class RespNamedFunction(_Doc):
    type: Literal["function"]
    name: str


class RespFormatText(_Doc):
    type: Literal["text"]


class RespFormatJSONObject(_Doc):
    type: Literal["json_object"]


class RespFormatJSONSchema(_Doc):
    type: Literal["json_schema"]
    name: NonEmpty
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[RespFormatText | RespFormatJSONObject | RespFormatJSONSchema,
                       Field(discriminator="type")]


class RespTextConfig(_Doc):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class CreateResponseRequest(_Doc):
    """POST /v1/responses: `input`, or a conversation to continue, or instructions alone."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"anyOf": [
        {"required": ["input"]}, {"required": ["previous_response_id"]},
        {"required": ["instructions"]}]})

    model: str | None = Field(
        None, description="A served model or alias; the `x-model` header wins over it. May be "
                          "left out when one model is served.")
    input: str | Annotated[list[InputItem], Field(min_length=1)] | None = Field(
        None, description="A user message, or a list of items; may be left out when "
                          "`previous_response_id` continues a conversation.")
    instructions: str | None = Field(None, description="A system message put first; not "
                                                       "carried over to later responses.")
    previous_response_id: str | None = Field(
        None, description="A stored response of the same key: its input and output are "
                          "prepended to `input`.")
    tools: list[RespFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | RespNamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: RespTextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]],
                        Field(max_length=MAX_METADATA)] | None = None
    store: bool | None = Field(True, description="Keep the response (--responses-ttl) for "
                                                 "retrieval and `previous_response_id`.")
    stream: bool | None = False
    user: str | None = None
    reasoning: dict[str, Any] | None = Field(None, description="Accepted and echoed.")
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    background: Literal[False] | None = Field(None, description="Only false: not supported.")
    top_logprobs: Literal[0] | None = Field(None, description="Only 0: not supported.")


# ---- answers ------------------------------------------------------------------------------


class RespOutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class RespOutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Status
    content: list[RespOutputText]


class RespFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"]
    status: Status
    call_id: str
    name: str
    arguments: str


class RespReasoning(BaseModel):
    id: str
    type: Literal["reasoning"]
    summary: list[RespSummaryText]
    content: list[RespReasoningText]


OutputItem = Annotated[RespOutputMessage | RespFunctionCall | RespReasoning,
                       Field(discriminator="type")]


class RespInputTextPart(BaseModel):
    type: Literal["input_text"]
    text: str


class RespInputMessageItem(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["user", "system", "developer"]
    status: Status
    content: list[RespInputTextPart]


class RespFunctionCallOutput(BaseModel):
    id: str
    type: Literal["function_call_output"]
    status: Status
    call_id: str
    output: str


class RespInputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose KV came from the prefix cache.")


class RespOutputTokensDetails(BaseModel):
    reasoning_tokens: int


class RespUsage(BaseModel):
    input_tokens: int
    input_tokens_details: RespInputTokensDetails
    output_tokens: int
    output_tokens_details: RespOutputTokensDetails
    total_tokens: int


class RespError(BaseModel):
    code: str
    message: str


class RespIncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response; with `stream`, its states arrive in the lifecycle events."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool
    error: RespError | None
    incomplete_details: RespIncompleteDetails | None
    model: str
    output: list[OutputItem]
    usage: RespUsage | None
    store: bool = Field(description="False when the response was not (or could not be) kept.")
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    temperature: float
    text: dict[str, Any]
    tool_choice: Literal["none", "auto", "required"] | RespNamedFunction
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["auto", "disabled"]
    user: str | None
    completed_at: int | None


class RespLifecycleEvent(BaseModel):
    type: Literal["response.created", "response.in_progress", "response.completed",
                  "response.incomplete", "response.failed"]
    sequence_number: int
    response: ResponseObject


class RespOutputItemEvent(BaseModel):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class RespContentPartEvent(BaseModel):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: RespOutputText | RespReasoningText


class RespDeltaEvent(BaseModel):
    type: Literal["response.output_text.delta", "response.reasoning_text.delta",
                  "response.function_call_arguments.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int | None = None
    delta: str
    logprobs: list[Any] | None = None


class RespTextDoneEvent(BaseModel):
    type: Literal["response.output_text.done", "response.reasoning_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] | None = None


class RespArgumentsDoneEvent(BaseModel):
    type: Literal["response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class RespErrorEvent(BaseModel):
    """A failure after the stream started (then `response.failed`)."""

    type: Literal["error"]
    sequence_number: int
    code: str | None
    message: str
    param: str | None


class ResponseStreamEvent(RootModel[Annotated[
        RespLifecycleEvent | RespOutputItemEvent | RespContentPartEvent | RespDeltaEvent
        | RespTextDoneEvent | RespArgumentsDoneEvent | RespErrorEvent,
        Field(discriminator="type")]]):
    """One event of a streamed response, named by its `type` (also the SSE `event`)."""


class RespInputItemList(BaseModel):
    object: Literal["list"]
    data: list[RespInputMessageItem | RespOutputMessage | RespFunctionCall
               | RespFunctionCallOutput | RespReasoning]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


__all__ = ["CreateResponseRequest", "DeletedResponse", "RespInputItemList", "ResponseObject",
           "ResponseStreamEvent"]
