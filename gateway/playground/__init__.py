"""GET /playground: a small chat page for trying the served models from a browser.

The page is static (index.html, playground.js, playground.css beside this module) and needs
no key to load; the calls it makes to /v1/models and /v1/chat/completions carry the key the
user types (kept in the browser's sessionStorage). Nothing is fetched from elsewhere: the
Content-Security-Policy below allows this origin alone. `--no-playground` leaves it out.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

HERE = Path(__file__).resolve().parent
# The files served, by the name the page asks for, with their media type.
FILES = {
    "index.html": "text/html; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
}
HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
}

router = APIRouter(include_in_schema=False)


def _file(name: str) -> FileResponse:
    if name not in FILES:
        raise HTTPException(status_code=404, detail="Not Found")
    return FileResponse(HERE / name, media_type=FILES[name], headers=HEADERS)


@router.get("/playground")
@router.get("/playground/")
async def page() -> FileResponse:
    return _file("index.html")


@router.get("/playground/{name}")
async def asset(name: str) -> FileResponse:
    return _file(name)
