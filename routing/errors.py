"""Routing failures the gateway turns into HTTP errors."""

from __future__ import annotations


class ModelNotFound(LookupError):
    """No served model or alias has this name: a 404 `model_not_found`."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name
        self.message = f"The model `{name}` does not exist or you do not have access to it."
