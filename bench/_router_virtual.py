"""The prefix-heavy sweep of ``bench/router.py`` on jumping virtual time: kvmesh's policies, seconds per point.

The same workload and cluster spec as the live part (``bench.router.prefix_workload`` and ``prefix_spec``:
shared 2048-token prefixes, Poisson arrivals, 4 H100s with 1024 KV blocks each, the working set swept from
one engine's cache to 4x it), replayed on ``cluster.virtual_cluster.VirtualCluster``: the engines' cost
model, schedulers and KV caches, and the router's own ``Chooser`` and policy fed by the engines' KV events.
What it leaves out: HTTP, the router's own CPU time (in the live part kvmesh's Python router pays ~1 ms of
emulated TTFT per request more than sgl-router's Rust), load reports a beat old (here each decision reads
the engines' load), and wall-clock step lag (0 by construction). sgl-router, a separate process, cannot run
on this clock; ``sglang_cache_aware``, which agrees with it decision for decision
(``tests/integration/test_sglang_agreement.py``), stands in for it.

Use it to check a policy change over every sweep point and several seeds before a live, locked run:
``python bench/router.py --parts prefix-virtual --ratios 1,2,4 --virtual-seeds 0,1,2,3``.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from typing import Any

import numpy as np

from actors.jump_clock import JumpClock
from bench.router import PREFIX_POLICIES, prefix_spec, prefix_workload
from cluster.loadtest.synthesis import PromptSynthesizer
from cluster.virtual_cluster import SimRecord, VirtualCluster

VIRTUAL_POLICIES = tuple(p for p in PREFIX_POLICIES if p != "sglang-router")


def replay_point(policy: str, ratio: float, n: int, rate: float, seed: int,
                 params: dict[str, float] | None = None) -> dict[str, Any]:
    """One policy (with ``params``, else its defaults) at one sweep point: hit ratio (prompt tokens served
    from cache), TTFT mean/p50/p99 (emulated ms) and the requests each engine served, smallest first."""
    trace, num_prefixes = prefix_workload(ratio, n, rate, seed=seed, offset=0)
    spec = prefix_spec(policy)
    if params:
        spec = spec.model_copy(update={"router": spec.router.model_copy(update={"policy_params": params})})
    synth = PromptSynthesizer(seed)
    clock = JumpClock()

    async def main() -> tuple[list[SimRecord], dict[str, float]]:
        vc = VirtualCluster(spec, clock, seed=seed)
        await vc.start()
        try:
            reqs = [(str(s.request_id), s.arrival_ms, functools.partial(synth.prompt, s), s.output_len)
                    for s in trace.requests]
            last = max(s.arrival_ms for s in trace.requests)
            return await clock.run(vc.replay(reqs), limit_ms=last + 3_600_000.0), vc.counters()
        finally:
            await vc.close()

    records, counters = asyncio.run(main())
    ttft = np.array([r.ttft_ms for r in records if r.ttft_ms is not None])
    return {"num_prefixes": num_prefixes, "served": int(ttft.size),
            "prefix_hit_ratio": round(counters["gpu_hits"] / max(1.0, counters["prefix_queries"]), 4),
            "ttft_mean_ms": round(float(ttft.mean()), 3), "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 3),
            "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 3),
            "requests_per_engine": sorted(Counter(r.engine for r in records).values())}


def prefix_virtual(ratios: list[float], seeds: list[int], n: int, rate: float,
                   policies: tuple[str, ...] = VIRTUAL_POLICIES) -> dict[str, Any]:
    """Every (ratio, seed, policy); a point's seed is the live part's (ratio x 100) plus ``seed``."""
    out: dict[str, Any] = {"method": "cluster.virtual_cluster on jumping virtual time (step lag 0, no HTTP)",
                           "requests": n, "rate_rps": rate}
    for ratio in ratios:
        for seed in seeds:
            row = {p: replay_point(p, ratio, n, rate, int(ratio * 100) + seed) for p in policies}
            out[f"x{ratio:g}-s{seed}"] = row
            print(f"prefix-virtual x{ratio:g} seed {seed}: " + "; ".join(
                f"{p} hit {r['prefix_hit_ratio']:.4f} TTFT mean {r['ttft_mean_ms']:.1f} p99 {r['ttft_p99_ms']:.1f}"
                for p, r in row.items()), flush=True)
    return out
