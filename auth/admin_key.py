"""What the server accepts as its admin key: long, and not a value printed in the repository.

The admin key mints keys with no limits, so a short or well-known one is refused at startup
rather than served: anyone who read the docs could otherwise guess it.
"""

from __future__ import annotations

MIN_ADMIN_KEY_LENGTH = 32
# Values the repository's docs and manifests have shown as examples or placeholders.
PLACEHOLDER_ADMIN_KEYS = frozenset({
    "change-me-replace-with-a-long-random-secret",
    "a-long-random-secret",
    "your-admin-key",
})
_PLACEHOLDER_MARKERS = ("change-me", "changeme", "replace-me", "replaceme")
_GENERATE = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


class WeakAdminKey(ValueError):
    """The admin key is too short or a placeholder; the message says how to make one."""


def check_admin_key(key: str) -> None:
    """Raise `WeakAdminKey` unless `key` could be a real secret (never quoting the key)."""
    folded = key.strip().lower()
    if folded in PLACEHOLDER_ADMIN_KEYS or any(m in folded for m in _PLACEHOLDER_MARKERS):
        raise WeakAdminKey(
            "the admin key (SWITCHYARD_ADMIN_KEY / --admin-key) is a documented placeholder; "
            f"generate a random one, e.g. $({_GENERATE})")
    if len(key.strip()) < MIN_ADMIN_KEY_LENGTH:
        raise WeakAdminKey(
            f"the admin key (SWITCHYARD_ADMIN_KEY / --admin-key) has {len(key.strip())} "
            f"characters; it must have at least {MIN_ADMIN_KEY_LENGTH}, random, e.g. "
            f"$({_GENERATE})")
