"""The Server-Sent Events response: watches for disconnects and always closes its body.

Starlette's StreamingResponse only listens for `http.disconnect` under older ASGI
spec versions and never closes the body iterator itself; here both are explicit,
so a client that drops a stream closes the backend's iterator at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.generation import wait_for_disconnect

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes]) -> None:
        super().__init__(frames, headers=SSE_HEADERS, media_type=self.media_type)
        self._frames = frames

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def produce() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the socket went away under us
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(produce)
                await wait_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self._frames, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
