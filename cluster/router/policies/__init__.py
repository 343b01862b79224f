"""Routing policies: each a small class that ranks candidate workers; the registry maps names to them."""

from __future__ import annotations

from cluster.router.policies import basic  # noqa: F401  (registers the basic policies)
from cluster.router.policies.base import POLICIES, RoutingPolicy, make_policy, register_policy

__all__ = ["POLICIES", "RoutingPolicy", "make_policy", "register_policy"]
