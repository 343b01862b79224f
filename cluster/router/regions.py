"""Region strategies: which regions a request may be served from, and what a remote choice costs.

- ``ROUND_ROBIN``: every eligible replica in every region, in rotation (cache and distance ignored).
- ``REGIONAL``: the policy chooses among the origin region's replicas; other regions only when none
  there is eligible (nearest first).
- ``GLOBAL``: every eligible replica, ranked by an estimate of time to first token: the round trip from
  the origin, plus the prefill of the blocks the replica does not hold (from its cost model), scaled by
  its queue. A remote cache hit wins when the prefill it saves exceeds the round trip.

A replica outside the origin region costs the emulated round trip, which the router waits before
forwarding (latency is emulated in the application; this kernel has no netem).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from cluster.router.view import RequestContext, WorkerInfo

RegionStrategy = Literal["ROUND_ROBIN", "REGIONAL", "GLOBAL"]
STRATEGIES: tuple[str, ...] = ("ROUND_ROBIN", "REGIONAL", "GLOBAL")


class Topology:
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
