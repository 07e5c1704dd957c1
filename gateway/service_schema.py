"""GET /health's body, as documented (OpenAPI)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class DeploymentHealth(BaseModel):
    ready: bool
    detail: str
    state: Literal["healthy", "unhealthy", "cooling_down"]
    in_flight: int
    load: dict[str, Any] | None = Field(
        None, description="While the model loads: the stage now (`stage`: name, progress "
                          "0-1, detail), the finished `stages` with their seconds, and the "
                          "`seconds` since loading began.")


class ModelHealth(BaseModel):
    ready: bool = Field(description="Some deployment of the model is ready.")
    detail: str
    deployments: dict[str, DeploymentHealth]


class Health(BaseModel):
    """200 when every model has a ready deployment; 503 while any model has none, or while
    the server drains before it exits. Where API keys are on, `models` only for the admin
    key (and never while draining)."""

    status: Literal["ok", "unavailable", "draining"]
    models: dict[str, ModelHealth] | None = Field(
        None, description="Each model's and deployment's state; where API keys are on, sent "
                    "with the admin key only.")
