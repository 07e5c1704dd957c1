"""Routing failures the gateway turns into HTTP errors."""

from __future__ import annotations

import math

from backends.base import DeploymentError, RequestError
from backends.embeddings import Task


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


_SERVES: dict[Task, str] = {
    "generate": "a text generation model (task: generate): it serves chat, completions and "
                "TGI's routes, not /v1/embeddings; serve an embedding model with `task: embed` "
                "(--task embed)",
    "embed": "an embedding model (task: embed): it serves /v1/embeddings only, not text "
             "generation",
}


def task_mismatch(model: str, task: Task) -> RequestError:
    """A request for what `model`'s task does not serve: a 400 naming the model and its task."""
    return RequestError(f"The model `{model}` is {_SERVES[task]}.", param="model",
                        code="model_task_mismatch")
