"""Headers a request's handling asks to add to its response, whoever answers it.

The auth guard stashes x-ratelimit-* here; the route or the error handler (a 429)
then answers, and this pure ASGI middleware adds them to the response start.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

RESPONSE_HEADERS_KEY = "switchyard.response_headers"


def add_response_headers(scope: Scope, headers: Mapping[str, str]) -> None:
    if headers:
        scope.setdefault(RESPONSE_HEADERS_KEY, {}).update(headers)


class ResponseHeadersMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_wrapper(message: Message) -> None:
            extra = scope.get(RESPONSE_HEADERS_KEY)
            if message["type"] == "http.response.start" and extra:
                encoded = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
                message = {**message, "headers": [*message.get("headers", []), *encoded]}
            await send(message)

        await self.app(scope, receive, send_wrapper)
