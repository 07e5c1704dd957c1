"""POST /v1/embeddings as documented (OpenAPI): OpenAI's CreateEmbeddingRequest and
CreateEmbeddingResponse. The route parses bodies with `gateway.embeddings.requests`; these
models only describe what it accepts and answers. Unknown fields are ignored."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.embeddings.requests import TOKEN_ID_MAX
from gateway.settings import RequestLimits

MAX_INPUTS = RequestLimits().max_embedding_inputs  # the default of --max-embedding-inputs
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX - 1)]
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Input = (Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)] | TokenIds
         | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)])


class CreateEmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    input: Input = Field(description=(
        "A text, a list of texts, a list of token ids (one input) or a list of lists of token "
        "ids. Each input must be non-empty and at most the model's max input tokens; at most "
        f"--max-embedding-inputs inputs (default {MAX_INPUTS})."))
    model: str | None = Field(None, description="The model (or alias); `x-model` wins.")
    encoding_format: Literal["float", "base64"] | None = Field(
        "float", description="base64: each vector as its little-endian float32 bytes.")
    dimensions: int | None = Field(None, ge=1, description=(
        "Keep the first N values and renormalise (models that normalise their vectors)."))
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int = Field(description="The input's position in `input`.")
    embedding: list[float] | str = Field(description="The vector, or its base64 bytes.")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class CreateEmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
