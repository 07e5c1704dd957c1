"""URLs as the log may show them: no userinfo, no query values (where keys like `?key=` hide).

`redact_url("https://u:p@host:8443/v1?key=s")` -> `"https://***@host:8443/v1?key=***"`.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")


def redact_url(url: str) -> str:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "<unparsable URL>"
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{port}"
    if parts.username is not None or parts.password is not None:
        netloc = f"***@{netloc}"
    query = "&".join(f"{pair.split('=', 1)[0]}=***" if "=" in pair else "***"
                     for pair in parts.query.split("&")) if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def redact_text(text: str) -> str:
    """`text` with every URL in it redacted."""
    return _URL.sub(lambda match: redact_url(match.group(0)), text)
