"""Routing policies: each a small class that ranks candidate workers; the registry maps names to them."""

from __future__ import annotations

from cluster.router.policies import basic, hashing, kv_aware, sglang_cache_aware  # noqa: F401  (registration)
from cluster.router.policies.base import (
    POLICIES,
    PolicyError,
    RoutingPolicy,
    check_policy,
    make_policy,
    register_policy,
)

__all__ = ["POLICIES", "PolicyError", "RoutingPolicy", "check_policy", "make_policy", "register_policy"]
