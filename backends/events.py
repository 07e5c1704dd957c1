"""Closing a backend's event iterator: how a backend learns that its request is over."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio

log = logging.getLogger("switchyard.backends")


async def close_events(events: AsyncIterator[Any] | None) -> None:
    """`aclose()` the iterator under a cancellation shield (a cancelled caller must still let
    the backend abort and free the request); a failure to close is logged, never raised."""
    aclose = getattr(events, "aclose", None)
    if aclose is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            await aclose()
        except Exception:
            log.exception("closing a backend generation failed")
