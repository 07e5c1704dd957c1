"""Routing failures the gateway turns into HTTP errors."""

from __future__ import annotations

import math

from backends.base import DeploymentError


class ModelNotFound(LookupError):
    """No served model or alias has this name: a 404 `model_not_found`."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name
        self.message = f"The model `{name}` does not exist or you do not have access to it."


class NoHealthyDeployment(DeploymentError):
    """Every deployment of a model is out of rotation: a 503 with `Retry-After`."""

    def __init__(self, model: str, retry_after: float) -> None:
        seconds = max(1, math.ceil(retry_after))
        super().__init__(
            f"No deployment of model `{model}` can take requests now (all are cooling down "
            f"after failures or failing health checks); retry in {seconds} s.",
            status_code=503, code="no_healthy_deployment", retry_after=seconds,
        )
        self.model = model
