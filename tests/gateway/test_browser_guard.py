"""Open mode against web pages (gateway/browser_guard.py), over a real server: a foreign
origin's request is refused (403) before any generation, so is a body that is not JSON
(415), and a DNS-rebound Host; same-origin and JSON clients, listed origins (with their CORS
headers) and keyed gateways are served as before. The Chromium runs are in
tests/gateway/test_playground.py."""

from __future__ import annotations

import json
import secrets

import httpx
import pytest

from gateway.app import create_app
from gateway.browser_guard import listens_on_loopback
from gateway.settings import Settings
from tests.gateway.conftest import ServeApp
from tests.gateway.echo_backend import EchoBackend

BODY = json.dumps({"model": "echo", "prompt": "hello there", "max_tokens": 2})
FOREIGN = "http://evil.example"
LISTED = "https://app.example.com"


class CountingEcho(EchoBackend):
    """An echo backend that counts the generations it was asked for."""

    def __init__(self) -> None:
        super().__init__(name="echo")
        self.generations = 0

    def generate(self, req):  # type: ignore[no-untyped-def]
        self.generations += 1
        return super().generate(req)


def _serve(serve_app: ServeApp, **settings: object) -> tuple[str, CountingEcho]:
    echo = CountingEcho()
    return serve_app(create_app(Settings(**settings), backends={"echo": echo})), echo


def _post(url: str, content_type: str | None, **headers: str) -> httpx.Response:
    if content_type is not None:
        headers["content-type"] = content_type
    return httpx.post(f"{url}/v1/completions", content=BODY.encode(), headers=headers,
                      timeout=10)


def _error(answer: httpx.Response, status: int, code: str) -> str:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["code"] == code and error["type"], error
    return error["message"]


def test_a_foreign_pages_text_plain_post_is_refused_in_open_mode(serve_app: ServeApp) -> None:
    url, echo = _serve(serve_app)
    message = _error(_post(url, "text/plain;charset=UTF-8", origin=FOREIGN), 403,
                     "cross_origin_forbidden")
    assert FOREIGN in message and "--cors-allow-origins" in message
    _error(_post(url, "application/json", origin=FOREIGN), 403, "cross_origin_forbidden")
    _error(_post(url, "application/json", origin="null"), 403, "cross_origin_forbidden")
    _error(_post(url, None, **{"sec-fetch-site": "cross-site"}), 403, "cross_origin_forbidden")
    _error(httpx.options(f"{url}/v1/completions", headers={
        "origin": FOREIGN, "access-control-request-method": "POST"}), 403,
        "cross_origin_forbidden")
    assert echo.generations == 0


@pytest.mark.parametrize("content_type", [
    "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""])
def test_a_body_that_is_not_json_is_a_415_in_open_mode(serve_app: ServeApp,
                                                        content_type: str) -> None:
    url, echo = _serve(serve_app)
    message = _error(_post(url, content_type), 415, "unsupported_media_type")
    assert "application/json" in message
    assert echo.generations == 0


def test_same_origin_and_plain_clients_are_served(serve_app: ServeApp) -> None:
    url, echo = _serve(serve_app)
    for content_type in ("application/json", "application/json; charset=utf-8", "text/json",
                         "application/merge-patch+json", None):
        assert _post(url, content_type).status_code == 200, content_type
    own = url.replace("127.0.0.1", "localhost")
    with httpx.Client(base_url=own) as http:  # the page's origin is the Host it asked
        answer = http.post("/v1/completions", content=BODY, headers={
            "origin": own, "content-type": "application/json", "sec-fetch-site": "same-origin"})
    assert answer.status_code == 200, answer.text
    assert httpx.get(f"{url}/playground", headers={"sec-fetch-site": "cross-site"}).is_success
    assert echo.generations == 6


def test_a_listed_origin_is_served_with_cors_headers(serve_app: ServeApp) -> None:
    url, echo = _serve(serve_app, cors_allow_origins=f"{LISTED}, http://localhost:3000")
    answer = _post(url, "application/json", origin=LISTED)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == LISTED
    preflight = httpx.options(f"{url}/v1/completions", headers={
        "origin": LISTED, "access-control-request-method": "POST",
        "access-control-request-headers": "content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == LISTED
    _error(_post(url, "application/json", origin=FOREIGN), 403, "cross_origin_forbidden")
    assert echo.generations == 1


def test_a_dns_rebound_host_is_refused_on_loopback(serve_app: ServeApp) -> None:
    url, echo = _serve(serve_app)
    port = url.rsplit(":", 1)[1]
    rebound = {"host": f"evil.example:{port}", "origin": f"http://evil.example:{port}"}
    _error(_post(url, "application/json", **rebound), 403, "host_forbidden")
    for host in (f"localhost:{port}", f"[::1]:{port}", f"127.0.0.2:{port}", "app.localhost"):
        assert _post(url, "application/json", host=host).status_code == 200, host
    wide, _ = _serve(serve_app, hostname="0.0.0.0")  # a server on the network names itself
    assert _post(wide, "application/json", **rebound).status_code == 200
    assert echo.generations == 4


def test_loopback_hostnames() -> None:
    assert listens_on_loopback("127.0.0.1") and listens_on_loopback("localhost")
    assert listens_on_loopback("::1")
    assert not listens_on_loopback("0.0.0.0") and not listens_on_loopback("10.0.0.5")


def test_keyed_gateways_are_left_to_their_keys(serve_app: ServeApp) -> None:
    admin = "sy-admin-" + secrets.token_urlsafe(24)
    url, echo = _serve(serve_app, admin_key=admin)
    _error(_post(url, "text/plain", origin=FOREIGN), 401, "invalid_api_key")
    bearer = {"authorization": f"Bearer {admin}"}
    made = httpx.post(f"{url}/admin/keys", json={"name": "t"}, headers=bearer, timeout=10)
    key = made.json()["key"]
    assert _post(url, "text/plain", authorization=f"Bearer {key}").status_code == 200
    assert echo.generations == 1


def test_cors_origins_must_be_origins() -> None:
    for bad in ("evil.example", "https://a.example/", "https://a.example/path", "ftp://a.b"):
        with pytest.raises(ValueError, match="not a web origin"):
            Settings(cors_allow_origins=bad)
    assert Settings(cors_allow_origins=" https://a.example ,http://b:3000").cors_origins() == \
        frozenset({"https://a.example", "http://b:3000"})
