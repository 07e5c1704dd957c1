"""Model registry, deployments, balancing, fallbacks, cooldowns and health checks."""

from routing.balancer import Balancer
from routing.deployment import Deployment, DeploymentState
from routing.errors import ModelNotFound, NoHealthyDeployment
from routing.health import HealthChecker
from routing.policy import RoutingPolicy
from routing.registry import ModelEntry, ModelRegistry
from routing.router import ModelRouter

__all__ = [
    "Balancer", "Deployment", "DeploymentState", "HealthChecker", "ModelEntry", "ModelNotFound",
    "ModelRegistry", "ModelRouter", "NoHealthyDeployment", "RoutingPolicy",
]
