"""One backend's pooled aiohttp session to its upstream: streamed POSTs and small GETs.

Created in the backend's start() (a session belongs to a running loop), closed in close().
A response read to its end gives its keep-alive connection back to the pool by itself;
closing one cut short drops the connection, which is how the upstream learns to abort.
Redirects are not followed (nor were they with httpx): a 3xx is no answer from a model.
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

from backends.remote.http import status_error, transport_errors
from backends.remote.options import UpstreamOptions

HEALTH_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
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


def make_session(options: UpstreamOptions, headers: dict[str, str]) -> aiohttp.ClientSession:
    tls = tls_context() if options.base_url.startswith("https://") else True
    # No limit on connections; sock_read bounds the wait between bytes of a stream.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S, ssl=tls)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=options.connect_timeout,
                                    sock_read=options.read_timeout)
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers, json_serialize=_dumps,
        cookie_jar=aiohttp.DummyCookieJar(), read_bufsize=READ_BUFSIZE,
    )


class UpstreamClient:
    def __init__(self, options: UpstreamOptions, headers: dict[str, str]) -> None:
        self.base_url = options.base_url
        self._proxy = env_proxy(options.base_url)
        self._session = make_session(options, headers)
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
                raw = await response.read()
            finally:
                response.close()
        raise status_error(response.status, raw, response.headers)

    async def get_json(self, path: str) -> Any:
        """A small GET (limits discovery): its JSON, or aiohttp's error for a 4xx / 5xx."""
        async with self._session.get(self.url(path), timeout=HEALTH_TIMEOUT, proxy=self._proxy,
                                     allow_redirects=False) as response:
            response.raise_for_status()
            raw = await response.read()
        return json.loads(raw)

    async def status(self, path: str) -> int:
        """The status of a GET, its body read so the connection stays reusable."""
        async with self._session.get(self.url(path), timeout=HEALTH_TIMEOUT, proxy=self._proxy,
                                     allow_redirects=False) as response:
            await response.read()
            return response.status

    async def close(self) -> None:
        await self._session.close()
