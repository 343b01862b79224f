"""KV-aware routing: weigh the prefill a worker's cached prefix saves against the load it carries.

For each eligible worker ``w``, in KV blocks::

    prefill(w) = request blocks w does not hold yet
                 + max(w's prefill backlog (queued prompts and unfinished prefills, reported)
                       + blocks the router sent w since that report,
                       blocks of prompts the router sent w whose first token it has not seen)
    cost(w)    = weight x prefill(w) + KV blocks in use on w (the decode load)
                 + duplicate_weight x (blocks the best-placed candidate holds that w does not)

as NVIDIA Dynamo's KV router scores workers, with ``overlap_weight`` (default 8, where Dynamo's is 1): a
queued prefill block delays the first token of everything behind it, a decode block costs one block of KV read
per step; at weight 1 on the Mooncake slice of ``bench/router.py`` a worker with long decodes lost to one with
a long prefill queue and TTFT p50 was worse than round robin's. The cheapest worker wins (``temperature`` 0),
or one is drawn with probability proportional to ``exp(-cost / (temperature x mean cost))`` to spread ties and
near-ties; among equal costs the larger overlap wins (a request for a prefix still prefilling on one worker
costs that worker its wait behind the prefill, as much as a fresh prefill elsewhere, but keeps one copy of the
prefix instead of two), then the lighter load. The remaining workers follow by cost, for retries.
Tiers: a prefix a worker holds in its CPU or disk tier, or in its region's KV store, counts as held, plus what
loading it costs in prefill blocks (``ctx.tier_load_blocks``: load time over prefill time, at most one per block;
``cluster.router.tiers``), so a CPU hit beats a cold prefill elsewhere when the load is faster than the compute.
Without the backlog term the queue a worker
already has is invisible (its blocks are not allocated yet), and a popular prefix piles requests onto one
worker. The router's own count of prompts awaiting their first token is exact and current, where a report is up
to a beat old and misses a request still on the wire (a beat that lands between the send and the engine's
receipt clears the pending count without showing the request): with one router the larger of the two is the
truth, with several the report covers the others' requests. The duplicate term prices what a myopic TTFT cost
misses when caches are full: sending a prefix away from the worker that holds it copies it into a second cache,
where it evicts another prefix that a later request will have to prefill again (on the prefix-heavy part of
``bench/router.py``, at a working set of 4x one engine's cache, kv_aware without it hit 57% of prompt tokens
where sgl-router's cache_aware, which never leaves a prefix's worker short of a large imbalance, hit 65%). A
request still moves when the holder's queue outweighs both terms. The overlap counts what the router sent a worker
and the KV events have not confirmed yet (``prefix_index.InflightPrefixes``), so a burst for a new prefix does
not scatter while the first of it is prefilling.

Waiting behind the current step. A request sent to an idle worker is planned at once; one sent to a busy worker
waits for the rest of the running step (half of it on average) and, with async scheduling, for the step already
planned behind it: ``steps_ahead`` (default 1.5) decode steps of the worker's batch, from the router's cost-model
step times (``ClusterView.timing``, ``cluster.router.timing``) and its own count of open requests (or the
reported running and waiting ones, if more), added to ``prefill(w)`` in prefill blocks::

    wait(w) = 0 if w has no request, else steps_ahead x decode_step_ms(w's requests, KV in use) / block_ms(w)

About 28 prefill blocks (~10 ms at 8B on an H100) for a miss of 136. The busy state is the router's own count
(exact with one router), where the KV in use comes from a report up to a feed interval old: a decode that just
began or ended does not show in it yet. Without timing (a worker type the catalog does not know) the term is 0.

Near ties. Where the cheapest workers before the wait hold the same overlap and their costs differ by less than
one request's KV footprint (its prompt and ``max_tokens`` blocks, ``near_tie_requests`` of them: a decode that
ends in a few steps), balance decides: the workers whose blocks computed so far (this policy's own count,
``on_routed``, cumulative) are within ``balance_requests`` (0.5) footprints of the least are balanced, and among
them the cheapest with the wait goes first; the others follow, fewest computed first (then cost, then name).
A request placed on a worker makes it the home of its prefix, which then draws that prefix's later requests
(the duplicate term keeps them there), so a miss decided by a momentary decode or by name order piles homes on
one worker: on the prefix-heavy part of ``bench/router.py`` at a working set of one engine's cache, the 8
prefixes landed 3/2/2/1 on 4 workers (one served 146 of 300 requests, another none) and TTFT mean was 5% over
sgl-router's; with the blocks computed as the tie-break they land 2/2/2/2. Idle first whatever the balance did
the same (38 against 108 requests, TTFT mean 4% worse at that point), so cost and wait decide only between
balanced workers; with the fewest computed first among those too, some misses went to a worker mid-decode
while another as balanced sat idle (47 -> 56-62 ms: kv_aware's TTFT p99 at 1x and 2x live). On
``bench/router.py --parts prefix-virtual`` (4 seeds x 1/2/4x, a perfect load feed) TTFT p99 at 2x seed 1 went
56.2 -> 47.3 ms and no point's mean got worse. A worker that joins late wins near ties until it has computed
its share. When every balanced worker is busy and another is idle, ``lookahead`` (off by default) weighs the wait
the miss saves against what balance saves the prefix's later requests (``cluster.router.policies.lookahead``,
with its measured effect: none at 1x/2x, where balance is right, mixed at 4x).
"""

from __future__ import annotations

import math
import random

from pydantic import Field

from cluster.router.policies.base import PolicyBase, register_policy
from cluster.router.policies.lookahead import HomeLookahead
from cluster.router.view import ClusterView, RequestContext, WorkerId, WorkerInfo
from config.base import Frozen


def footprint_blocks(ctx: RequestContext, block_size: int) -> int:
    """KV blocks the request will hold at its end: its prompt's and ``max_tokens``' (0 when absent or bad)."""
    max_tokens = ctx.body.get("max_tokens")
    out = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0 else 0
    return ctx.num_blocks + -(-out // max(1, block_size))


@register_policy("kv_aware")
class KVAware(PolicyBase):
    class Params(Frozen):
        overlap_weight: float = Field(default=8.0, ge=0)
        """Weight of a prefill block against a decode block."""
        temperature: float = Field(default=0.0, ge=0)
        """0: the cheapest worker; above 0, a softmax draw over relative costs."""
        duplicate_weight: float = Field(default=8.0, ge=0)
        """Weight of a block the request would copy from another worker's cache into this one's."""
        near_tie_requests: float = Field(default=1.0, ge=0)
        """Costs closer than this many of the request's KV footprints are near ties (0: exact ties only)."""
        balance_requests: float = Field(default=0.5, ge=0)
        """Near ties whose blocks computed are within this many of the request's footprints of the least are
        balanced: among them the wait decides (0: the least computed always goes first)."""
        steps_ahead: float = Field(default=1.5, ge=0)
        """Steps a request sent to a busy worker waits before its own: the rest of the running one (half on
        average) and the one async scheduling planned ahead (0.5 for synchronous engines; 0: no wait term)."""
        lookahead: bool = False
        """True: a new prefix home may skip the balance rule for a less busy worker when the wait it saves
        outweighs what balance saves the prefix's later requests (``policies.lookahead``; off by default: on
        the virtual prefix sweep it changed nothing at 1x/2x and was mixed at 4x)."""

    name = "kv_aware"
    reason = "kv_cost"
    needs_prefix = True
    ranks_on_counts = True

    def __init__(self, rng: random.Random, params: KVAware.Params) -> None:
        super().__init__(rng, params)
        self.weight = params.overlap_weight
        self.temperature = params.temperature
        self.duplicate_weight = params.duplicate_weight
        self.near_tie = params.near_tie_requests
        self.steps_ahead = params.steps_ahead
        self.balance = params.balance_requests
        self.computed: dict[WorkerId, int] = {}
        """Prompt blocks this policy sent each worker to compute (its count of what it routed, never reset)."""
        self.lookahead = HomeLookahead() if params.lookahead else None
        self._now_s = 0.0
        self._capacity = 0

    def cost(self, w: WorkerInfo, ctx: RequestContext, best_overlap: int = 0, wait: float = 0.0) -> float:
        held = ctx.overlap.get(w.name, 0) + ctx.tier_hits.get(w.name, 0)
        new = max(0, ctx.num_blocks - held) + ctx.tier_load_blocks.get(w.name, 0.0)
        backlog = max(w.prefill_backlog_tokens / max(1, w.block_size) + w.pending_blocks, w.prefilling_blocks)
        return self.weight * (new + backlog + wait) + w.used_blocks \
            + self.duplicate_weight * max(0, best_overlap - held)

    def wait_blocks(self, w: WorkerInfo, view: ClusterView) -> float:
        """The wait behind ``w``'s current work before a new request's first step, in prefill blocks: none on
        an idle worker; on a busy one ``steps_ahead`` decode steps of its batch (the router's open requests or
        the reported running and waiting ones, whichever is more, over the KV it reports in use)."""
        seqs = w.load
        timing = view.timing
        if seqs <= 0 or self.steps_ahead <= 0 or timing is None:
            return 0.0
        block = timing.block_ms(w)
        step = timing.decode_step_ms(w, seqs, w.used_blocks * w.block_size)
        if not block or step is None:
            return 0.0
        return self.steps_ahead * step / block

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        best = max((ctx.overlap.get(w.name, 0) for w in candidates), default=0)
        if self.lookahead is not None:
            self._now_s, self._capacity = view.now(), sum(w.num_blocks for w in candidates)
            self.lookahead.observe(candidates, self._now_s)
        waits = {w.name: self.wait_blocks(w, view) for w in candidates}
        costs = {w.name: self.cost(w, ctx, best, waits[w.name]) for w in candidates}
        ordered = self.near_ties(sorted(candidates, key=lambda w: (costs[w.name], -ctx.overlap.get(w.name, 0),
                                                                   w.load, w.name)), costs, ctx, waits)
        self.reason = "cache_hit" if best and ctx.overlap.get(ordered[0].name, 0) == best \
            else "load"
        if self.temperature <= 0 or len(ordered) == 1:
            return ordered
        mean = sum(costs.values()) / len(costs) or 1.0
        lo = costs[ordered[0].name]
        weights = [math.exp(-(costs[w.name] - lo) / (self.temperature * mean)) for w in ordered]
        pick = self.rng.choices(range(len(ordered)), weights=weights)[0]
        return [ordered[pick], *ordered[:pick], *ordered[pick + 1:]]

    def near_ties(self, ordered: list[WorkerInfo], costs: dict[WorkerId, float], ctx: RequestContext,
                  waits: dict[WorkerId, float]) -> list[WorkerInfo]:
        """``ordered`` (by cost) with the near ties of its first worker first (see the module docstring): those of
        the same overlap whose costs before the wait are within the slack of its own, the ones balanced within
        ``balance_requests`` footprints of the least computed first, cheapest with the wait first, then the
        others, fewest blocks computed first."""
        load = {k: c - self.weight * waits[k] for k, c in costs.items()}
        top = ordered[0]
        overlap = ctx.overlap.get(top.name, 0)
        footprint = footprint_blocks(ctx, top.block_size)
        slack = self.near_tie * footprint
        near = [w for w in ordered
                if ctx.overlap.get(w.name, 0) == overlap
                and (abs(load[w.name] - load[top.name]) < slack or load[w.name] == load[top.name])]
        if len(near) < 2:
            return ordered
        computed = {w.name: self.computed.get(w.name, 0) for w in near}
        even = min(computed.values()) + self.balance * footprint
        near.sort(key=lambda w: (0, costs[w.name], computed[w.name], w.name) if computed[w.name] <= even
                  else (1, computed[w.name], costs[w.name], w.name))
        if self.lookahead is not None and overlap == 0 and waits[near[0].name] > 0:
            near = self.look_ahead(near, waits)
        return near + [w for w in ordered if w not in near]

    def look_ahead(self, near: list[WorkerInfo], waits: dict[WorkerId, float]) -> list[WorkerInfo]:
        """A new home: the balanced first choice waits behind its step; the least waiting of the others goes
        first instead when ``HomeLookahead.idle_first`` says the wait saved outweighs the balance kept."""
        assert self.lookahead is not None
        first = near[0]
        other = min(near[1:], key=lambda w: (waits[w.name], self.computed.get(w.name, 0), w.name))
        if not self.lookahead.idle_first(first, other, waits[first.name], waits[other.name], self._capacity,
                                         self._now_s):
            return near
        return [other, *(w for w in near if w is not other)]

    def on_routed(self, worker: WorkerInfo, ctx: RequestContext) -> None:
        held = ctx.overlap.get(worker.name, 0)
        new = ctx.num_blocks - held
        worker.pending_blocks += new
        self.computed[worker.name] = self.computed.get(worker.name, 0) + max(0, new)
        if self.lookahead is not None:
            self.lookahead.routed(held, new, self._now_s)
