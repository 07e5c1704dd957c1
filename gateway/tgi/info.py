"""TGI's `GET /info` body, from the backend's `ModelInfo` (its `extra` carries the engine's
knobs: max_batch_total_tokens, max_concurrent_requests, waiting_served_ratio, ...)."""

from __future__ import annotations

from typing import Any

from backends.base import ModelInfo
from gateway.tgi.requests import MAX_BEST_OF, MAX_STOP_SEQUENCES, MAX_TOP_N_TOKENS

# TGI's field -> the ModelInfo.extra key that holds it (None where the backend has none).
_ENGINE_FIELDS = (
    "max_concurrent_requests", "waiting_served_ratio", "max_batch_total_tokens",
    "max_waiting_tokens", "max_batch_size", "max_batch_prefill_tokens", "block_size",
)


def _torch_dtype(dtype: str) -> str:
    """TGI reports torch's spelling, `torch.float16`."""
    if dtype == "unknown" or dtype.startswith("torch."):
        return dtype
    return f"torch.{dtype}"


def info_body(info: ModelInfo, *, version: str) -> dict[str, Any]:
    extra = dict(info.extra)
    body: dict[str, Any] = {
        "model_id": extra.pop("model_id", info.name),
        "model_sha": None,
        "model_dtype": _torch_dtype(info.dtype),
        "dtype_reason": extra.pop("dtype_reason", None),  # ours: why this dtype on this machine
        "model_device_type": extra.pop("device", None),
        "model_pipeline_tag": "text-generation",
        "max_best_of": MAX_BEST_OF,
        "max_stop_sequences": MAX_STOP_SEQUENCES,
        "max_top_n_tokens": MAX_TOP_N_TOKENS,  # TGI's launcher flag, reported for clients
        "max_input_tokens": info.max_input_tokens,
        "max_input_length": info.max_input_tokens,  # TGI < 2.0's name
        "max_total_tokens": info.max_total_tokens,
        "max_client_batch_size": 1,
        "router": "switchyard",
        "version": version,
        "sha": None,
        "docker_label": None,
        "served_model_name": info.name,
        "backend": info.backend,
        "quantization": extra.pop("quantization", info.quantization),
    }
    for name in _ENGINE_FIELDS:
        body[name] = extra.pop(name, None)
    body.update(extra)  # whatever else the backend reports, under its own names
    return body
