"""API keys, stores, rate limits. Today only open mode."""

from auth.access import AccessDenied, AccessPolicy, OpenAccess, Principal, bearer_token

__all__ = ["AccessDenied", "AccessPolicy", "OpenAccess", "Principal", "bearer_token"]
