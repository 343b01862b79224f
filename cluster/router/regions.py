"""Region strategies: which regions a request may be served from, and what a remote choice costs.

A strategy ranks the eligible pool for one request given the policy; each lives in ``REGION_STRATEGIES``
under its config name, like the policies:

- ``ROUND_ROBIN``: every eligible replica in every region, in rotation (cache and distance ignored).
- ``REGIONAL``: the policy chooses among the origin region's replicas; other regions only when none
  there is eligible (nearest first).
- ``GLOBAL``: every eligible replica, ranked by an estimate of time to first token: the round trip from
  the origin, plus the prefill of the blocks the replica does not hold (from its cost model), scaled by
  its queue. A remote cache hit wins when the prefill it saves exceeds the round trip.

``needs_prefix`` says whether the strategy reads prefix overlaps (GLOBAL does, whatever the policy).
A replica outside the origin region costs the emulated round trip, which the router waits before
forwarding (latency is emulated in the application; this kernel has no netem).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import ClassVar, Protocol

from cluster.router.policies.base import NoParams, RoutingPolicy
from cluster.router.policies.basic import RoundRobin
from cluster.router.view import ClusterView, RequestContext, WorkerInfo


class Topology:
    """Round-trip times between regions (symmetric; 0 within a region or for an unknown pair)."""

    def __init__(self, rtt_ms: dict[tuple[str, str], float] | None = None) -> None:
        self._rtt = {}
        for (a, b), v in (rtt_ms or {}).items():
            self._rtt[(a, b)] = v
            self._rtt[(b, a)] = v

    def rtt_ms(self, a: str | None, b: str) -> float:
        if a is None or a == b:
            return 0.0
        return self._rtt.get((a, b), 0.0)


PrefillEstimate = Callable[[WorkerInfo, int, int], float]
"""(worker, uncached tokens, cached tokens) -> emulated ms of that prefill on the worker."""


def global_rank(candidates: list[WorkerInfo], ctx: RequestContext, topo: Topology,
                prefill_ms: PrefillEstimate) -> list[WorkerInfo]:
    n_tokens = len(ctx.prompt_ids)

    def est(w: WorkerInfo) -> float:
        cached = min(n_tokens - 1, ctx.overlap.get(w.name, 0) * w.block_size) if n_tokens else 0
        work = prefill_ms(w, max(1, n_tokens - cached), cached)
        return topo.rtt_ms(ctx.origin_region, w.region) + work * (1 + w.waiting) + 0.001 * w.load

    return sorted(candidates, key=lambda w: (est(w), w.name))


def regional_split(candidates: list[WorkerInfo], ctx: RequestContext,
                   topo: Topology) -> tuple[list[WorkerInfo], list[WorkerInfo]]:
    """(replicas in the origin region, the rest nearest first)."""
    if ctx.origin_region is None:
        return candidates, []
    local = [w for w in candidates if w.region == ctx.origin_region]
    rest = sorted((w for w in candidates if w.region != ctx.origin_region),
                  key=lambda w: (topo.rtt_ms(ctx.origin_region, w.region), w.name))
    return local, rest


class RegionStrategy(Protocol):
    needs_prefix: ClassVar[bool]

    def rank(self, policy: RoutingPolicy, pool: list[WorkerInfo], ctx: RequestContext,
             view: ClusterView) -> list[WorkerInfo]:
        """The pool (non-empty, in name order) ordered best first."""
        ...


class RoundRobinRegions:
    needs_prefix: ClassVar[bool] = False

    def __init__(self, topology: Topology, prefill_ms: PrefillEstimate) -> None:
        self._rotation = RoundRobin(random.Random(0), NoParams())

    def rank(self, policy: RoutingPolicy, pool: list[WorkerInfo], ctx: RequestContext,
             view: ClusterView) -> list[WorkerInfo]:
        return self._rotation.rank(pool, ctx, view)


class Regional:
    needs_prefix: ClassVar[bool] = False

    def __init__(self, topology: Topology, prefill_ms: PrefillEstimate) -> None:
        self.topology = topology

    def rank(self, policy: RoutingPolicy, pool: list[WorkerInfo], ctx: RequestContext,
             view: ClusterView) -> list[WorkerInfo]:
        local, rest = regional_split(pool, ctx, self.topology)
        return policy.rank(local, ctx, view) + rest if local else rest


class Global:
    needs_prefix: ClassVar[bool] = True

    def __init__(self, topology: Topology, prefill_ms: PrefillEstimate) -> None:
        self.topology = topology
        self.prefill_ms = prefill_ms

    def rank(self, policy: RoutingPolicy, pool: list[WorkerInfo], ctx: RequestContext,
             view: ClusterView) -> list[WorkerInfo]:
        return global_rank(pool, ctx, self.topology, self.prefill_ms)


REGION_STRATEGIES: dict[str, Callable[[Topology, PrefillEstimate], RegionStrategy]] = {
    "ROUND_ROBIN": RoundRobinRegions,
    "REGIONAL": Regional,
    "GLOBAL": Global,
}


def make_region_strategy(name: str, topology: Topology, prefill_ms: PrefillEstimate) -> RegionStrategy:
    try:
        return REGION_STRATEGIES[name](topology, prefill_ms)
    except KeyError:
        raise ValueError(f"unknown region strategy {name!r} (known: {', '.join(REGION_STRATEGIES)})") from None
