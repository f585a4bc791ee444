"""Routers as pure functions (``routing``), their auxiliary losses (``losses``) and synthetic
routing with controllable skew for benchmarks, the simulator and tests (``synthetic``)."""

from mixmoe.gating.losses import load_balancing_loss, router_z_loss
from mixmoe.gating.routing import gshard_route, route, scored_route, switch_route, topk_route

__all__ = [
    "gshard_route",
    "load_balancing_loss",
    "route",
    "router_z_loss",
    "scored_route",
    "switch_route",
    "topk_route",
]
