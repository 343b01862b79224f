"""The policy interface and its registry.

A policy has one job: rank the candidate workers for a request, best first. The router around it owns
health, retries, timeouts and metrics, and tries the next ranked worker when one fails.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Protocol

from cluster.router.view import ClusterView, RequestContext, WorkerInfo


class RoutingPolicy(Protocol):
    name: str

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        """Candidates ordered best first (callers pass a non-empty, stably ordered list)."""
        ...


PolicyFactory = Callable[[random.Random], RoutingPolicy]
POLICIES: dict[str, PolicyFactory] = {}


def register_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    def deco(factory: PolicyFactory) -> PolicyFactory:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} registered twice")
        POLICIES[name] = factory
        return factory
    return deco


def make_policy(name: str, rng: random.Random | None = None) -> RoutingPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown routing policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None
    return factory(rng or random.Random(0))
