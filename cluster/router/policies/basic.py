"""Load-only policies: round robin and least loaded."""

from __future__ import annotations

import random

from cluster.router.policies.base import register_policy
from cluster.router.view import ClusterView, RequestContext, WorkerInfo


@register_policy("round_robin")
class RoundRobin:
    """Cycle through the candidates in name order; the rest follow in cycle order (for retries)."""

    name = "round_robin"

    def __init__(self, rng: random.Random) -> None:
        self._next = 0

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        i = self._next % len(candidates)
        self._next += 1
        return candidates[i:] + candidates[:i]


@register_policy("least_loaded")
class LeastLoaded:
    """Fewest requests this router has open on the worker; ties broken by fewest sent, then name."""

    name = "least_loaded"

    def __init__(self, rng: random.Random) -> None:
        pass

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        return sorted(candidates, key=lambda w: (w.inflight, w.sent, w.name))
