"""Per-model sampling defaults: what a request that omits temperature, top_p, top_k, min_p or
repetition_penalty gets.

Precedence, value by value: the request's own > the models file's `defaults:` > the
`--sampling-defaults` flag > the checkpoint's generation_config (ModelInfo.sampling_defaults;
the default model's card) > SamplingParams' neutral values. A remote model has no checkpoint
here: without configured defaults its requests carry what they always did.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from backends.base import NO_SAMPLING_DEFAULTS, ModelInfo, SamplingDefaults

if TYPE_CHECKING:
    from routing.registry import ModelEntry


class SamplingDefaultsDeclaration(BaseModel):
    """`defaults:` of a model in the models file, or the flag's JSON object. The ranges are
    the request fields' (gateway/openai/requests.py)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, le=10, allow_inf_nan=False)

    def defaults(self) -> SamplingDefaults:
        top_k = None if self.top_k is None else max(self.top_k, 0)
        return SamplingDefaults(self.temperature, self.top_p, top_k, self.min_p,
                                self.repetition_penalty)


def declared(value: SamplingDefaultsDeclaration | None) -> SamplingDefaults:
    return NO_SAMPLING_DEFAULTS if value is None else value.defaults()


def from_json_text(value: Any) -> Any:
    """The flag's (or variable's) JSON text as an object; anything else as given."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a JSON object: {exc}") from None


def effective(entry: ModelEntry, info: ModelInfo | None) -> SamplingDefaults:
    """The model's defaults: the configured ones over the checkpoint's (None: not known yet)."""
    own = NO_SAMPLING_DEFAULTS if info is None else info.sampling_defaults
    return entry.sampling_defaults.over(own)


def current_info(entry: ModelEntry) -> ModelInfo | None:
    """The model's info; None while it cannot say (loading, or its backend failing)."""
    try:
        return entry.router.info()
    except Exception:
        return None


async def model_info(entry: ModelEntry) -> ModelInfo | None:
    """`current_info` off the event loop (a remote backend may read its tokenizer)."""
    return await asyncio.to_thread(current_info, entry)
