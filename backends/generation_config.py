"""A checkpoint folder's generation_config.json, and the sampling defaults it sets."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from backends.base import SamplingDefaults

_log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


def read_generation_config(folder: str) -> dict[str, Any]:
    """The folder's generation_config.json as read; {} when it has none."""
    file = os.path.join(folder, GENERATION_CONFIG)
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        values = json.load(f)
    return values if isinstance(values, dict) else {}


def sampling_defaults(values: Mapping[str, Any]) -> SamplingDefaults:
    """The sampling defaults a generation config sets, as vLLM's `--generation-config auto`
    takes them (`do_sample` is not consulted, as there); one out of range is skipped."""
    top_k = _number(values, "top_k", lambda v: v >= 0 and float(v).is_integer())
    return SamplingDefaults(
        temperature=_number(values, "temperature", lambda v: 0 <= v <= 2),
        top_p=_number(values, "top_p", lambda v: 0 < v <= 1),
        top_k=None if top_k is None else int(top_k),
        min_p=_number(values, "min_p", lambda v: 0 <= v <= 1),
        repetition_penalty=_number(values, "repetition_penalty", lambda v: 0 < v <= 10),
    )


def _number(values: Mapping[str, Any], name: str,
            valid: Callable[[float], bool]) -> float | None:
    value = values.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and valid(value)):
        _log.warning("generation_config.json: ignoring %s=%r (out of range)", name, value)
        return None
    return float(value)
