"""Load-only policies: round robin, random, least loaded, power of two choices."""

from __future__ import annotations

import random

from cluster.router.policies.base import PolicyBase, by_load, register_policy
from cluster.router.view import ClusterView, RequestContext, WorkerInfo


@register_policy("round_robin")
class RoundRobin(PolicyBase):
    """Cycle through the candidates in name order; the rest follow in cycle order (for retries)."""

    name = "round_robin"
    reason = "rotation"

    def __init__(self, rng: random.Random, params: object) -> None:
        super().__init__(rng, params)
        self._next = 0

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        i = self._next % len(candidates)
        self._next += 1
        return candidates[i:] + candidates[:i]


@register_policy("random")
class RandomChoice(PolicyBase):
    name = "random"
    reason = "random"

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        out = list(candidates)
        self.rng.shuffle(out)
        return out


@register_policy("least_loaded")
class LeastLoaded(PolicyBase):
    """Fewest requests open (the router's count or the engine's report, whichever is larger)."""

    name = "least_loaded"
    reason = "least_load"

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        return by_load(candidates)


@register_policy("power_of_two")
class PowerOfTwo(PolicyBase):
    """Sample two workers at random, take the less loaded (Mitzenmacher); the rest by load for retries."""

    name = "power_of_two"
    reason = "two_choices"

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        if len(candidates) <= 2:
            return by_load(candidates)
        pair = by_load(self.rng.sample(candidates, 2))
        rest = by_load([w for w in candidates if w not in pair])
        return pair[:1] + by_load(pair[1:] + rest)
