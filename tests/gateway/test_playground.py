"""/playground: the static chat page, driven in a real headless Chromium.

A real uvicorn server with API keys on (a real redis-server; the key is made through the
admin API) serves two echo backends that stream word by word. Playwright drives Debian's
chromium (never a downloaded browser): load the page, enter the key, pick the model, send,
watch the answer stream in, read TTFT and tok/s; then a failure mid-stream and a wrong key,
each shown as the server sent it. Without chromium (or playwright) the browser test skips
and says which is missing.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import tomllib
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from gateway.app import create_app
from gateway.cli import build_parser, settings_from_args
from gateway.errors import internal_error
from gateway.settings import Settings
from tests.auth.conftest import RedisServer
from tests.gateway.conftest import ServeApp, running_server
from tests.gateway.echo_backend import WORDS, EchoBackend

REPO = Path(__file__).resolve().parents[2]
STATIC = REPO / "gateway" / "playground"
ADMIN_KEY = "sy-admin-" + secrets.token_urlsafe(32)
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
TIMEOUT_MS = 15_000
# Predicates as functions: a string expression would be eval'd, which the page's CSP forbids.
TWO_MODELS = "() => document.querySelectorAll('#model option').length === 2"


def _chromium() -> str | None:
    """SWITCHYARD_CHROMIUM, else a Chromium on PATH (Debian's `chromium` package)."""
    given = os.environ.get("SWITCHYARD_CHROMIUM")
    if given:
        return given
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


# ---- the page as files and routes (no browser) ----


def test_page_is_served_without_a_key_and_left_out_of_openapi(serve_app: ServeApp) -> None:
    app = create_app(Settings(admin_key=ADMIN_KEY), backends={"echo": EchoBackend()})
    url = serve_app(app)
    for path in ("/playground", "/playground/"):
        page = httpx.get(f"{url}{path}")
        assert page.status_code == 200, page.text
        assert page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert "<title>Switchyard playground</title>" in page.text
    for name, kind in (("playground.js", "text/javascript"), ("playground.css", "text/css")):
        asset = httpx.get(f"{url}/playground/{name}")
        assert asset.status_code == 200
        assert asset.headers["content-type"].startswith(kind)
        assert asset.content == (STATIC / name).read_bytes()
    for missing in ("nope.js", "__init__.py", "..%2Fapp.py"):
        assert httpx.get(f"{url}/playground/{missing}").status_code == 404
    # the API it calls is still guarded
    assert httpx.get(f"{url}/v1/models").status_code == 401
    paths = httpx.get(f"{url}/openapi.json").json()["paths"]
    assert not [p for p in paths if p.startswith("/playground")]


def test_no_playground_flag(serve_app: ServeApp) -> None:
    assert Settings().playground is True
    assert settings_from_args(build_parser().parse_args(["serve"])).playground is True
    args = build_parser().parse_args(["serve", "--no-playground"])
    settings = settings_from_args(args)
    assert settings.playground is False
    url = serve_app(create_app(settings, backends={"echo": EchoBackend()}))
    for path in ("/playground", "/playground/", "/playground/playground.js"):
        assert httpx.get(f"{url}{path}").status_code == 404
    assert httpx.get(f"{url}/v1/models").status_code == 200


_COMMENTS = {
    ".js": re.compile(r"/\*.*?\*/|(?<![:\"'\\])//[^\n]*", re.DOTALL),
    ".css": re.compile(r"/\*.*?\*/", re.DOTALL),
    ".html": re.compile(r"<!--.*?-->", re.DOTALL),
}


def test_static_files_reference_nothing_outside() -> None:
    files = sorted(p for p in STATIC.iterdir() if p.suffix in _COMMENTS)
    assert {p.name for p in files} == {"index.html", "playground.js", "playground.css"}
    for path in files:
        code = _COMMENTS[path.suffix].sub("", path.read_text())
        assert not re.search(r"https?://", code, re.IGNORECASE), path.name
        # protocol-relative or other absolute references (src="//cdn...", url(//...))
        assert not re.search(r"""(?:src|href|action)\s*=\s*["']?\s*//""", code), path.name
        assert not re.search(r"""url\(\s*["']?\s*(?://|[a-z]+:)""", code), path.name
        assert "@import" not in code, path.name


def test_static_files_are_package_data() -> None:
    """setuptools ships every file the page serves (pyproject's package-data)."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["gateway.playground"]
    for path in STATIC.iterdir():
        if path.suffix in _COMMENTS:
            assert any(fnmatch(path.name, g) for g in globs), path.name
    assert (STATIC / "__init__.py").exists()  # a package, found by packages.find


# ---- in the browser ----


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the Python package 'playwright' is missing (pip install -e '.[dev]')")
    executable = _chromium()
    if executable is None:
        pytest.skip("no Chromium binary: install Debian's 'chromium' (apt-get install chromium, "
                    "or scripts/setup.sh as root), or set SWITCHYARD_CHROMIUM; this test never "
                    "downloads a browser ('playwright install')")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, headless=True,
                                              args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def echo() -> EchoBackend:
    # 0.1 s per word: slow enough to see the answer grow, quick enough to test
    return EchoBackend(name="echo", max_total_tokens=4096, delay_s=0.1)


@pytest.fixture(scope="module")
def keyed(redis_server: RedisServer, echo: EchoBackend) -> Iterator[tuple[str, str, EchoBackend]]:
    """(gateway URL, an API key made through the admin API, the `echo` backend)."""
    backends = {"echo": echo, "another": EchoBackend(name="another")}
    app = create_app(Settings(admin_key=ADMIN_KEY, redis_url=redis_server.url), backends=backends)
    with running_server(app) as url:
        made = httpx.post(f"{url}/admin/keys", json={"name": "playground"},
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
        assert made.status_code == 201, made.text
        yield url, made.json()["key"], backends["another"]


def _last_answer(page: Any) -> Any:
    return page.locator("article.msg.assistant").last


def _send(page: Any, text: str) -> None:
    page.fill("#message", text)
    page.press("#message", "Enter")


def test_chat_streams_in_the_browser(
    browser: Any, keyed: tuple[str, str, EchoBackend], echo: EchoBackend,
) -> None:
    url, key, another = keyed
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    crashes: list[str] = []
    console: list[str] = []
    page.on("pageerror", lambda exc: crashes.append(str(exc)))
    page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
    external: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(url) else external.append(r.url))
    try:
        page.goto(f"{url}/playground")
        # No key yet: the model list is refused, and the page says so as the server did.
        error = page.locator("#error")
        error.wait_for(state="visible")
        assert "HTTP 401 invalid_api_key: Missing API key" in error.inner_text()

        # The key: typed, kept in sessionStorage (only), and the models load with it.
        page.fill("#api-key", key)
        page.dispatch_event("#api-key", "change")
        page.wait_for_function(TWO_MODELS)
        assert page.locator("#model option").all_inner_texts() == ["another", "echo"]
        assert error.is_hidden()
        assert page.evaluate("sessionStorage.getItem('switchyard.playground.apiKey')") == key
        assert page.evaluate("localStorage.length") == 0
        page.select_option("#model", "echo")

        page.fill("#system-prompt", "Be brief.")
        page.fill("#temperature", "0.5")
        page.fill("#top-p", "0.9")
        page.fill("#max-tokens", "6")
        before = len(echo.requests)
        _send(page, "hello there")

        # Streaming: the text shows while the answer is still coming.
        page.wait_for_function(
            "() => { const a = [...document.querySelectorAll('article.msg.assistant')].pop();"
            " return a && a.getAttribute('aria-busy') === 'true'"
            " && a.querySelector('.content').textContent.length > 0; }")
        partial = _last_answer(page).locator(".content").inner_text()
        assert partial and " ".join(WORDS[:6]).startswith(partial)
        stats = _last_answer(page).locator(".stats").first
        stats.wait_for()
        assert _last_answer(page).locator(".content").inner_text() == " ".join(WORDS[:6])
        assert page.locator("article.msg.user .content").all_inner_texts() == ["hello there"]
        # "Be brief." + "hello there": 4 prompt words; 6 tokens (max_tokens)
        assert re.fullmatch(r"TTFT \d+ ms · \d+\.\d tok/s · 6 tokens · prompt 4",
                            stats.inner_text()), stats.inner_text()
        ttft_ms = float(stats.get_attribute("data-ttft-ms"))
        rate = float(stats.get_attribute("data-tokens-per-second"))
        assert 90 <= ttft_ms < 5000  # the first word waits one 0.1 s step
        assert 0.5 < rate < 100  # 0.1 s per word: ~10 tok/s
        assert "Cut at max tokens." in _last_answer(page).inner_text()

        # What the backend was asked: the picked model, the parameters, the system prompt.
        assert len(echo.requests) == before + 1 and not another.requests
        request = echo.requests[-1]
        assert request.messages == [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "hello there"}]
        sampling = request.sampling
        assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (0.5, 0.9, 6)

        # A second turn carries the conversation.
        page.fill("#max-tokens", "2")
        _send(page, "more")
        page.locator("article.msg.assistant").nth(1).locator(".stats").first.wait_for()
        assert _last_answer(page).locator(".content").inner_text() == " ".join(WORDS[:2])
        assert [m["role"] for m in echo.requests[-1].messages] == [
            "system", "user", "assistant", "user"]
        assert echo.requests[-1].messages[2]["content"] == " ".join(WORDS[:6])

        # A failure after the stream began arrives as an error event: shown as sent.
        page.fill("#max-tokens", "")
        _send(page, "FAIL_MIDWAY now")
        answer_error = _last_answer(page).locator(".msg-error")
        answer_error.wait_for()
        expected = internal_error()
        assert error.is_visible()
        assert error.inner_text() == f"{expected.code}: {expected.message}"
        assert answer_error.inner_text() == error.inner_text()
        assert _last_answer(page).locator(".content").inner_text() == " ".join(WORDS[:2])
        assert page.input_value("#message") == "FAIL_MIDWAY now"  # kept, to retry

        # A wrong key: the server's 401, its message and code, on the page.
        wrong = "sk-sy-" + secrets.token_urlsafe(24)
        sent = httpx.post(f"{url}/v1/chat/completions", headers={
            "Authorization": f"Bearer {wrong}"},
            json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]})
        assert sent.status_code == 401
        server_error = sent.json()["error"]
        page.fill("#api-key", wrong)
        page.dispatch_event("#api-key", "change")
        error.wait_for(state="visible")
        page.wait_for_function("() => document.getElementById('error').textContent"
                               ".includes('HTTP 401')")
        assert page.locator("#model option").count() == 2  # the list stays to try again
        page.select_option("#model", "echo")
        count = page.locator("article.msg.assistant").count()
        _send(page, "hello again")
        page.locator("article.msg.assistant").nth(count).locator(".msg-error").wait_for()
        shown = error.inner_text()
        assert shown == (f"HTTP 401 {server_error['code']}: {server_error['message']}"), shown
        assert error.get_attribute("data-code") == "invalid_api_key"
        assert error.get_attribute("data-status") == "401"
        assert page.evaluate("sessionStorage.getItem('switchyard.playground.apiKey')") == wrong

        assert not crashes, crashes
        assert not [line for line in console if "Content Security Policy" in line], console
        assert not external, external
    finally:
        context.close()


def test_key_stays_in_the_tab(browser: Any, keyed: tuple[str, str, EchoBackend]) -> None:
    """sessionStorage: a reload keeps the key; a new browser context (session) does not."""
    url, key, _ = keyed
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(f"{url}/playground")
        page.fill("#api-key", key)
        page.dispatch_event("#api-key", "change")
        page.wait_for_function(TWO_MODELS)
        page.reload()
        assert page.input_value("#api-key") == key
        page.wait_for_function(TWO_MODELS)
        page.click("#forget-key")
        assert page.evaluate("sessionStorage.length") == 0
    finally:
        context.close()
    fresh = browser.new_context()
    try:
        page = fresh.new_page()
        page.goto(f"{url}/playground")
        assert page.input_value("#api-key") == ""
    finally:
        fresh.close()


FOREIGN_PAGE = """<!doctype html><script>
fetch("%s/v1/completions", {method: "POST", mode: "no-cors", headers: {"Content-Type":
  "text/plain"}, body: JSON.stringify({model: "echo", prompt: "csrf", max_tokens: 2})})
  .then(() => { document.title = "sent"; }, () => { document.title = "failed"; });
</script>"""


def test_open_mode_serves_the_playground_and_refuses_other_pages(
        browser: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Without keys: the page chats (same origin, JSON), while a page from another origin
    that makes the browser POST a text/plain body to the gateway (CSRF) generates nothing."""
    echo = EchoBackend(name="echo")
    with running_server(create_app(Settings(), backends={"echo": echo})) as url:
        context = browser.new_context()
        try:
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(f"{url}/playground")
            page.wait_for_function("() => document.querySelectorAll('#model option').length")
            _send(page, "hello there")
            _last_answer(page).locator(".stats").first.wait_for()
            assert _last_answer(page).locator(".content").inner_text().startswith(WORDS[0])
            assert len(echo.requests) == 1

            other = FastAPI()  # another origin: the same host, another port
            other.get("/")(lambda: HTMLResponse(FOREIGN_PAGE % url))
            with running_server(other) as evil_url:
                evil = context.new_page()
                caplog.set_level(logging.INFO, logger="switchyard.access")
                evil.goto(evil_url)
                evil.wait_for_function("() => document.title !== ''")
            lines = [r.getMessage() for r in caplog.records if r.name == "switchyard.access"]
            # It reached the gateway (the browser sent it) and was refused there.
            assert any(line.startswith("POST /v1/completions 403 ") for line in lines), lines
            assert len(echo.requests) == 1
        finally:
            context.close()
