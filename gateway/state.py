"""What the routes share, kept on `app.state.gateway`."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from auth.access import AccessPolicy
from gateway.metrics import GatewayMetrics
from gateway.settings import Settings
from routing.registry import ModelRegistry


@dataclass
class GatewayState:
    settings: Settings
    models: ModelRegistry
    metrics: GatewayMetrics
    access: AccessPolicy


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway
