"""How much an upstream's answer may hold: a whole body, one line and one event of a stream.

An upstream is trusted to speak HTTP, not to be small: past these bounds the request fails
with a 502 `upstream_too_large` instead of the gateway's memory growing with the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.base import DeploymentError

MIB = 2**20
ERROR_BODY_BYTES = 64 * 1024  # what is read of an error answer (its message is quoted)


@dataclass(frozen=True)
class ResponseLimits:
    max_body_bytes: int = 16 * MIB
    max_line_bytes: int = MIB
    max_event_bytes: int = 4 * MIB


def too_large(what: str, limit: int) -> DeploymentError:
    return DeploymentError(
        f"the upstream's answer is too large: {what} exceeded {limit} bytes (raise the "
        "deployment's limit if this upstream really sends that much)",
        status_code=502, code="upstream_too_large")
