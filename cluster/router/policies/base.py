"""The policy interface and its registry.

A policy has one job: rank the eligible workers for a request, best first. The router around it owns
eligibility (health, breakers, residency, regions), retries, timeouts, migration and metrics, and tries
the next ranked worker when one fails. ``reason`` names why the first choice was made (for metrics).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from cluster.router.view import ClusterView, RequestContext, WorkerInfo


class RoutingPolicy(Protocol):
    name: str
    reason: str

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        """Candidates ordered best first (callers pass a non-empty list in name order)."""
        ...

    def on_routed(self, worker: WorkerInfo, ctx: RequestContext) -> None:
        """The request went to ``worker`` (policies with their own state update it here)."""
        ...


PolicyFactory = Callable[[random.Random, Mapping[str, Any]], RoutingPolicy]
POLICIES: dict[str, PolicyFactory] = {}


def register_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    def deco(factory: PolicyFactory) -> PolicyFactory:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} registered twice")
        POLICIES[name] = factory
        return factory
    return deco


def make_policy(name: str, rng: random.Random | None = None, params: Mapping[str, Any] | None = None) -> RoutingPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown routing policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None
    return factory(rng or random.Random(0), dict(params or {}))


class PolicyBase:
    """Defaults for the optional parts of the interface."""

    name = "base"
    reason = "policy"

    def on_routed(self, worker: WorkerInfo, ctx: RequestContext) -> None:
        return None


def by_load(candidates: list[WorkerInfo]) -> list[WorkerInfo]:
    """Least loaded first; ties broken by fewer requests sent, then name (deterministic)."""
    return sorted(candidates, key=lambda w: (w.load, w.waiting, w.sent, w.name))
