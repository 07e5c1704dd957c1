"""Open mode against web pages: what a browser may send a gateway that checks no keys.

With keys on, a page cannot call the gateway for a user: its request needs the key in an
`Authorization` header, which a cross-origin page can only send after a CORS preflight we
never grant. In open mode nothing is secret, so any page the user visits could make their
browser POST to a gateway on localhost or their LAN (CSRF), or, by rebinding its DNS name to
that address, read the answers. This pure ASGI middleware closes both, in open mode only:

- a request whose `Origin` is neither the gateway's own (its `Host`) nor listed in
  `--cors-allow-origins` gets 403 `cross_origin_forbidden`; so does a request of a method
  with a body that carries no `Origin` but `Sec-Fetch-Site: cross-site` / `same-site`;
- a POST, PUT or PATCH whose Content-Type is not JSON (`application/json`, `text/json`,
  `*/*+json`) gets 415 `unsupported_media_type`: a page can send `text/plain`, a form or a
  multipart body without a preflight, never JSON; a body with no Content-Type is still read
  as JSON (curl and SDKs that omit it);
- when the gateway listens on a loopback address, a `Host` that is not a loopback name or
  address gets 403 `host_forbidden`: a rebound DNS name reaches the gateway with its own name.

The playground (same origin, JSON bodies, a loopback or the server's own host) is unaffected.
`--cors-allow-origins` also answers those origins' CORS preflights and adds
`Access-Control-Allow-Origin` to their responses, in every mode (Starlette's CORSMiddleware).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.error_shapes import shaped_response
from gateway.errors import OpenAIError

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
JSON_TYPES = frozenset({"application/json", "text/json"})
LOOPBACK_NAMES = frozenset({"localhost", "localhost."})
_DEFAULT_PORTS = {"http": "80", "https": "443", "ws": "80", "wss": "443"}


@dataclass(frozen=True)
class BrowserPolicy:
    """What the guard enforces; `open_mode` False turns it off."""

    open_mode: bool
    allowed_origins: frozenset[str] = frozenset()
    loopback_only: bool = False  # the gateway listens on a loopback address

    def refusal(self, scope: Scope) -> OpenAIError | None:
        headers = _headers(scope)
        return (self._origin_refusal(scope, headers) or self._host_refusal(headers)
                or _media_type_refusal(scope, headers))

    def _origin_refusal(self, scope: Scope, headers: dict[str, str]) -> OpenAIError | None:
        origin = headers.get("origin")
        if origin is not None:
            if origin in self.allowed_origins or _same_origin(origin, headers.get("host"),
                                                               scope.get("scheme", "http")):
                return None
            return _forbidden(f"Requests from the web page at {origin[:200]} are refused: this "
                              "gateway runs without API keys (open mode) and serves only its "
                              "own origin. List the origin with --cors-allow-origins, or turn "
                              "API keys on.", "cross_origin_forbidden")
        site = headers.get("sec-fetch-site")
        if scope.get("method") not in SAFE_METHODS and site in ("cross-site", "same-site"):
            return _forbidden("Requests from other web sites are refused: this gateway runs "
                              "without API keys (open mode).", "cross_origin_forbidden")
        return None

    def _host_refusal(self, headers: dict[str, str]) -> OpenAIError | None:
        if not self.loopback_only or _is_loopback(headers.get("host", "")):
            return None
        return _forbidden("This gateway listens on a loopback address without API keys (open "
                          "mode) and answers only requests addressed to localhost or a "
                          "loopback IP (a Host header naming another host is how a DNS "
                          "rebinding page reaches it).", "host_forbidden")


def _headers(scope: Scope) -> dict[str, str]:
    return {name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope.get("headers", ())}


def _forbidden(message: str, code: str) -> OpenAIError:
    return OpenAIError(403, message, code=code, error_type="permission_error")


def _media_type_refusal(scope: Scope, headers: dict[str, str]) -> OpenAIError | None:
    if scope.get("method") not in BODY_METHODS or "content-type" not in headers:
        return None
    media = headers["content-type"].split(";", 1)[0].strip().lower()
    if media in JSON_TYPES or (media.startswith("application/") and media.endswith("+json")):
        return None
    return OpenAIError(415, f"The request body must be JSON (Content-Type: application/json), "
                            f"not {media[:100] or 'an empty type'}.",
                       param=None, code="unsupported_media_type")


def _authority(netloc: str, scheme: str) -> str:
    """host[:port] in lower case, without the scheme's default port."""
    netloc = netloc.strip().lower()
    default = _DEFAULT_PORTS.get(scheme)
    if default and netloc.endswith(f":{default}"):
        netloc = netloc[: -len(default) - 1]
    return netloc


def _same_origin(origin: str, host: str | None, scheme: str) -> bool:
    """Whether `origin` names this server as the request reached it (its Host header)."""
    if host is None:
        return False
    parts = urlsplit(origin)
    if not parts.scheme or not parts.netloc:
        return False  # "null" (sandboxed frames, file: pages) and garbage
    # Behind a TLS proxy the page is https and we see http: the host and port decide.
    return _authority(parts.netloc, parts.scheme) in (
        _authority(host, scheme), _authority(host, parts.scheme))


def _is_loopback(host: str) -> bool:
    name = urlsplit(f"//{host}").hostname or ""
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def listens_on_loopback(hostname: str) -> bool:
    """Whether --hostname is a loopback name or address (not 0.0.0.0, not a LAN address)."""
    return _is_loopback(f"[{hostname}]" if ":" in hostname else hostname)


class BrowserGuardMiddleware:
    def __init__(self, app: ASGIApp, policy: BrowserPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = None
        if scope["type"] == "http" and self.policy.open_mode:
            refusal = self.policy.refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        response = shaped_response(scope["path"], refusal) or refusal.response()
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})
