"""Routers as pure functions (``routing``) and their auxiliary losses (``losses``)."""

from mixmoe.gating.losses import load_balancing_loss, router_z_loss
from mixmoe.gating.routing import gshard_route, route, switch_route, topk_route

__all__ = [
    "gshard_route",
    "load_balancing_loss",
    "route",
    "router_z_loss",
    "switch_route",
    "topk_route",
]
