"""The body of POST /v1/embeddings, with OpenAI's names, shapes and limits.

`input` is a string, a list of strings, a list of token ids (one input) or a list of lists of
token ids; every input must be non-empty, and a request holds at most
`--max-embedding-inputs` of them (OpenAI's 2048). `encoding_format` is `float` (the default)
or `base64`; `dimensions` (>= 1) asks for shortened vectors; `user` is accepted. Strict types;
unknown fields are ignored, as on the other endpoints. Each mistake is a 400 naming the field
(`input[3]` for one input).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backends.embeddings import EmbeddingInput
from gateway.errors import OpenAIError, bad_request
from gateway.openai.messages import checked_text

TOKEN_ID_MAX = 2**31  # token ids are below this
SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


class EmbeddingBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    input: Any = Field(...)  # parsed by `inputs()`, which names the input at fault
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None  # None: float
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("model", "user")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return None if value is None else checked_text(value)

    @property
    def base64(self) -> bool:
        return self.encoding_format == "base64"


def inputs(value: Any, max_inputs: int) -> tuple[EmbeddingInput, ...]:
    """The request's inputs, or a 400 naming what is wrong."""
    if isinstance(value, str):
        return (_text(value, "input"),)
    if not isinstance(value, list):
        raise bad_request(f"'input' must be {SHAPES}.", "input", "invalid_type")
    if not value:
        raise bad_request("'input' must not be empty.", "input", "invalid_value")
    if all(_is_token_id(v) for v in value):
        return (_ids(value, "input"),)
    if len(value) > max_inputs:
        raise bad_request(
            f"Invalid 'input': array too long. Expected an array with maximum length "
            f"{max_inputs}, but got an array with length {len(value)} instead.", "input",
            "array_above_max_length")
    if all(isinstance(v, str) for v in value):
        return tuple(_text(v, f"input[{i}]") for i, v in enumerate(value))
    if all(isinstance(v, list) for v in value):
        return tuple(_ids(v, f"input[{i}]") for i, v in enumerate(value))
    raise bad_request(f"'input' must be {SHAPES}, not a mix of them.", "input", "invalid_type")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(value: str, where: str) -> str:
    if not value:
        raise _empty(where)
    return value


def _ids(value: list[Any], where: str) -> tuple[int, ...]:
    if not value:
        raise _empty(where)
    if not all(_is_token_id(v) and 0 <= v < TOKEN_ID_MAX for v in value):
        raise bad_request(f"'{where}' must be a list of token ids (integers from 0 to "
                          f"{TOKEN_ID_MAX - 1}).", where, "invalid_value")
    return tuple(value)


def _empty(where: str) -> OpenAIError:
    return bad_request(f"'{where}' is empty; every input needs some text or token ids.",
                       where, "invalid_value")
