"""Model registry, deployments, balancing, fallbacks."""

from routing.errors import ModelNotFound
from routing.registry import Deployment, ModelEntry, ModelRegistry

__all__ = ["Deployment", "ModelEntry", "ModelNotFound", "ModelRegistry"]
