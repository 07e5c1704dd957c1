"""One backend's pooled aiohttp session to its upstream: streamed POSTs and small GETs.

Created in the backend's start() (a session belongs to a running loop), closed in close().
A response read to its end gives its keep-alive connection back to the pool by itself;
closing one cut short drops the connection, which is how the upstream learns to abort.
Redirects are not followed (nor were they with httpx): a 3xx is no answer from a model.
At most `max_connections` connections are open to the upstream (more requests wait for one);
a request takes at most `request_timeout` seconds in all, `read_timeout` between two bytes.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.request
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

from backends.remote.http import read_body, read_error_body, status_error, transport_errors
from backends.remote.limits import ERROR_BODY_BYTES
from backends.remote.options import UpstreamOptions

HEALTH_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
PROBE_CONNECTIONS = 2
# Idle connections are dropped before the 5 s keep-alive of uvicorn (vLLM, SGLang, Switchyard)
# and most servers, so a request seldom goes out on a socket the upstream is closing.
KEEPALIVE_S = 4.0
READ_BUFSIZE = 2**20  # a line (one SSE event) may be up to twice this
_dumps = partial(json.dumps, separators=(",", ":"), ensure_ascii=False)


def env_proxy(url: str) -> str | None:
    """The proxy HTTP(S)_PROXY / ALL_PROXY name for `url`, unless NO_PROXY exempts its host
    (as httpx read the environment); looked up once, not per request."""
    parts = urlsplit(url)
    if urllib.request.proxy_bypass_environment(parts.hostname or ""):
        return None
    proxies = urllib.request.getproxies_environment()
    return proxies.get(parts.scheme) or proxies.get("all")


def tls_context() -> ssl.SSLContext:
    """The CAs httpx trusted: SSL_CERT_FILE / SSL_CERT_DIR, else certifi's bundle (else the
    system's), so an upstream reachable before stays reachable."""
    if os.environ.get("SSL_CERT_FILE"):
        return ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    if os.environ.get("SSL_CERT_DIR"):
        return ssl.create_default_context(capath=os.environ["SSL_CERT_DIR"])
    try:
        import certifi
    except ImportError:
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())


def make_session(
    options: UpstreamOptions, headers: dict[str, str], connections: int,
) -> aiohttp.ClientSession:
    tls = tls_context() if options.base_url.startswith("https://") else True
    connector = aiohttp.TCPConnector(limit=connections, keepalive_timeout=KEEPALIVE_S, ssl=tls)
    # total: the whole request, waiting for a pooled connection and reading the stream
    # included; sock_read: the wait between two bytes.
    timeout = aiohttp.ClientTimeout(total=options.request_timeout,
                                    sock_connect=options.connect_timeout,
                                    sock_read=options.read_timeout)
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers, json_serialize=_dumps,
        cookie_jar=aiohttp.DummyCookieJar(), read_bufsize=READ_BUFSIZE,
    )


class UpstreamClient:
    def __init__(self, options: UpstreamOptions, headers: dict[str, str]) -> None:
        self.base_url = options.base_url
        self.limits = options.limits()
        self._proxy = env_proxy(options.base_url)
        self._session = make_session(options, headers, options.max_connections)
        # Health checks and discovery on connections of their own: a pool busy with long
        # streams is not a dead upstream.
        self._probes = make_session(options, headers, PROBE_CONNECTIONS)
        self._urls: dict[str, URL] = {}

    def url(self, path: str) -> URL:
        """`base_url + path`, parsed once per path."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.base_url + path)
        return url

    async def open_stream(self, path: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """POST `body` and return the streaming response once its status is known to be 2xx.
        The caller reads it to its end, then closes it (close() also when cut short)."""
        with transport_errors(self.base_url):
            response = await self._session.post(self.url(path), json=body, proxy=self._proxy,
                                                allow_redirects=False)
            if response.status < 400:
                return response
            try:
                raw = await read_error_body(response)
            finally:
                response.close()
        raise status_error(response.status, raw, response.headers)

    async def read_whole(self, response: aiohttp.ClientResponse) -> bytes:
        """A non-streamed answer's body, at most the deployment's `max_response_bytes`."""
        with transport_errors(self.base_url):
            return await read_body(response, self.limits.max_body_bytes)

    async def get_json(self, path: str) -> Any:
        """A small GET (limits discovery): its JSON, or aiohttp's error for a 4xx / 5xx."""
        async with self._probes.get(self.url(path), timeout=HEALTH_TIMEOUT, proxy=self._proxy,
                                     allow_redirects=False) as response:
            response.raise_for_status()
            raw = await read_body(response, self.limits.max_body_bytes)
        return json.loads(raw)

    async def status(self, path: str) -> int:
        """The status of a GET, its body read so the connection stays reusable (a large one is
        dropped with its connection)."""
        async with self._probes.get(self.url(path), timeout=HEALTH_TIMEOUT, proxy=self._proxy,
                                     allow_redirects=False) as response:
            body = await read_error_body(response)
            if len(body) >= ERROR_BODY_BYTES:
                response.close()
            return response.status

    async def answers(self, path: str, body: dict[str, Any], timeout: float) -> bool:
        """Whether the upstream answers a small POST within `timeout` seconds (any status
        below 500: it is up and serving)."""
        try:
            async with self._probes.post(
                    self.url(path), json=body, timeout=aiohttp.ClientTimeout(total=timeout),
                    proxy=self._proxy, allow_redirects=False) as response:
                await read_error_body(response)
                return response.status < 500
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def close(self) -> None:
        await self._session.close()
        await self._probes.close()
