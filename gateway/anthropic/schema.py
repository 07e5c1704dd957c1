"""Anthropic's Messages API bodies: the request (parsed strictly, and documented from the same
models) and the answers (documented; `translate.py` and `stream.py` build them as dicts).

Strict types (no "1" for 1); unknown fields are ignored, as on the OpenAI routes. Content
blocks are told apart by `type`; a block type we do not serve is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_SEQUENCES = 4  # the default of --max-stop-sequences (checked against the setting)
ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class AnthropicTextBlock(_Strict):
    type: Literal["text"]
    text: str


class AnthropicImageBlock(_Strict):
    """Accepted by the schema so the refusal can say why: no vision model is served."""

    type: Literal["image"]
    source: dict[str, Any]


class AnthropicToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: ToolName
    input: dict[str, Any]


class AnthropicToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[AnthropicTextBlock | AnthropicImageBlock,
                                  Field(discriminator="type")]] = ""
    is_error: bool = False


class AnthropicThinkingBlock(_Strict):
    """An earlier answer's reasoning, handed back (its template may render it)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class AnthropicRedactedThinkingBlock(_Strict):
    """Another server's encrypted reasoning: nothing here can read it, so it is dropped."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    AnthropicTextBlock | AnthropicImageBlock | AnthropicToolUseBlock | AnthropicToolResultBlock
    | AnthropicThinkingBlock | AnthropicRedactedThinkingBlock, Field(discriminator="type")]


class AnthropicInputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]


class AnthropicTool(_Strict):
    type: Literal["custom"] | None = Field(None, description="Only client tools ('custom').")
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="A JSON Schema of the tool's input.")


class AnthropicToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class AnthropicToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class AnthropicToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: ToolName
    disable_parallel_tool_use: bool = False


class AnthropicToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[
    AnthropicToolChoiceAuto | AnthropicToolChoiceAny | AnthropicToolChoiceTool
    | AnthropicToolChoiceNone, Field(discriminator="type")]


class AnthropicThinkingEnabled(_Strict):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1, description="Accepted, not enforced: a thinking model "
                                                  "reasons until it closes its reasoning.")


class AnthropicThinkingDisabled(_Strict):
    type: Literal["disabled"]


Thinking = Annotated[AnthropicThinkingEnabled | AnthropicThinkingDisabled,
                     Field(discriminator="type")]


class AnthropicJSONOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="The answer's JSON Schema.")


class AnthropicOutputConfig(_Strict):
    format: AnthropicJSONOutputFormat | None = None


class AnthropicMetadata(_Strict):
    user_id: str | None = None


class AnthropicConversationFields(_Strict):
    """What a conversation is: shared by /v1/messages and /v1/messages/count_tokens."""

    model: str | None = Field(None, description="The model or alias; the x-model header wins. "
                                                "Left out: the only model served.")
    messages: list[AnthropicInputMessage] = Field(min_length=1)
    system: str | Annotated[list[AnthropicTextBlock], Field(min_length=1)] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class AnthropicMessagesRequest(AnthropicConversationFields):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    output_config: AnthropicOutputConfig | None = None
    metadata: AnthropicMetadata | None = None


class AnthropicCountTokensRequest(AnthropicConversationFields):
    pass


# ---- answers (documentation) ------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicTextOut(BaseModel):
    type: Literal["text"]
    text: str


class AnthropicThinkingOut(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str = Field(description="Empty: the reasoning is not signed here.")


class AnthropicToolUseOut(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ContentOut = Annotated[AnthropicTextOut | AnthropicThinkingOut | AnthropicToolUseOut,
                       Field(discriminator="type")]


class AnthropicMessageUsage(BaseModel):
    input_tokens: int = Field(description="Prompt tokens not read from the prefix cache.")
    output_tokens: int
    cache_read_input_tokens: int = Field(description="Prompt tokens the prefix cache served.")
    cache_creation_input_tokens: int = 0


class AnthropicMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: AnthropicMessageUsage


class AnthropicCountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicMessageStreamEvent(BaseModel):
    """One event's data; its `type` is also the SSE event name."""

    model_config = ConfigDict(extra="allow")

    type: Literal["message_start", "content_block_start", "content_block_delta",
                  "content_block_stop", "message_delta", "message_stop", "ping", "error"]


class AnthropicErrorDetail(BaseModel):
    type: Literal["invalid_request_error", "authentication_error", "permission_error",
                  "not_found_error", "request_too_large", "rate_limit_error", "api_error",
                  "overloaded_error", "timeout_error"]
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body, on every answer of these routes that is not a 2xx."""

    type: Literal["error"]
    error: AnthropicErrorDetail
