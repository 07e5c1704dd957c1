"""TGI's `GET /info` body, from the backend's `ModelInfo` (its `extra` carries the engine's
knobs: max_batch_total_tokens, max_concurrent_requests, waiting_served_ratio, ...)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse

from backends.base import BackendUnavailable, ModelInfo
from gateway.errors import from_backend_unavailable, tgi_error_response
from gateway.settings import RequestLimits
from gateway.tgi.requests import MAX_BEST_OF, MAX_TOP_N_TOKENS
from routing.deployment import Deployment
from routing.health import probe

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


def info_body(info: ModelInfo, *, version: str,
              limits: RequestLimits | None = None) -> dict[str, Any]:
    limits = limits or RequestLimits()
    extra = dict(info.extra)
    body: dict[str, Any] = {
        "model_id": extra.pop("model_id", info.name),
        "model_sha": None,
        "model_dtype": _torch_dtype(info.dtype),
        "dtype_reason": extra.pop("dtype_reason", None),  # ours: why this dtype on this machine
        "cpu_kernels": extra.pop("cpu_kernels", None),  # ours: which CPU kernels, or why none
        "model_device_type": extra.pop("device", None),
        "model_pipeline_tag": "text-generation",
        "max_best_of": MAX_BEST_OF,
        "max_stop_sequences": limits.max_stop_sequences,
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
    body["request_limits"] = limits.report()  # ours: --max-request-body-bytes and the rest
    return body


async def loading_response(deployments: Sequence[Deployment], exc: BackendUnavailable,
                           timeout_s: float = 5.0) -> JSONResponse:
    """503 while the model loads: TGI's error shape plus `load`, each deployment's load
    stages (the stage now with its progress, the finished ones with their seconds)."""
    response = tgi_error_response(from_backend_unavailable(exc))
    healths = await asyncio.gather(*(probe(d.backend, timeout_s) for d in deployments))
    load = {d.name: h.load.report() for d, h in zip(deployments, healths, strict=True)
            if h.load is not None}
    if not load:
        return response
    body = {**json.loads(response.body), "load": load}
    return JSONResponse(body, status_code=response.status_code,
                        headers={k: v for k, v in response.headers.items()
                                 if k.lower() not in ("content-length", "content-type")})
