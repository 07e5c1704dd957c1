"""API keys, key stores (memory, config file, Redis), per-key limits and usage. No torch."""

from auth.access import (
    AccessDenied,
    AccessPolicy,
    Admission,
    FreeAdmission,
    OpenAccess,
    Principal,
    bearer_token,
)
from auth.factory import AuthConfig, build_access
from auth.limits import Consumed

__all__ = [
    "AccessDenied", "AccessPolicy", "Admission", "AuthConfig", "Consumed", "FreeAdmission",
    "OpenAccess", "Principal", "bearer_token", "build_access",
]
