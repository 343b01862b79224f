"""Hash-affinity policies: session affinity and prefix hash, both by rendezvous (consistent) hashing.

Rendezvous hashing ranks workers by ``hash(key, worker)``: a key keeps its worker while that worker
stays, and when a worker joins or leaves only the keys that hash to it move. The full ranking doubles
as the retry order.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct

from pydantic import Field

from cluster.router.policies.base import PolicyBase, by_load, register_policy
from cluster.router.view import ClusterView, RequestContext, WorkerInfo
from config.base import Frozen


def rendezvous(key: bytes, candidates: list[WorkerInfo]) -> list[WorkerInfo]:
    def weight(w: WorkerInfo) -> int:
        return int.from_bytes(hashlib.blake2b(key + b"|" + w.name.encode(), digest_size=8).digest(), "little")

    return sorted(candidates, key=weight, reverse=True)


@register_policy("session_affinity")
class SessionAffinity(PolicyBase):
    """Requests of one session (``X-Session-Id`` header or body ``session_id``) go to one worker.

    A request without a session id goes to the least loaded worker.
    """

    name = "session_affinity"
    reason = "session"

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        if not ctx.session_id:
            self.reason = "no_session"
            return by_load(candidates)
        self.reason = "session"
        return rendezvous(ctx.session_id.encode(), candidates)


@register_policy("prefix_hash")
class PrefixHash(PolicyBase):
    """Consistent hash of the request's first ``prefix_blocks`` KV block hashes (default 4), with bounded
    loads (Mirrokni, Thorup and Zadimoghaddam, 2018): a worker already holding ``load_factor`` times its
    share of the requests (default 1.25; 0 turns the bound off) passes the request on along the ranking.
    Without the bound a prefix every request shares (a system prompt) sends the whole trace to one worker.
    """

    class Params(Frozen):
        prefix_blocks: int = Field(default=4, gt=0)
        """Leading KV blocks hashed into the key."""
        load_factor: float = Field(default=1.25, ge=0)
        """A worker holding this many times its share passes the request on (0: no bound)."""

    name = "prefix_hash"
    reason = "prefix_hash"
    needs_prefix = True

    def __init__(self, rng: random.Random, params: PrefixHash.Params) -> None:
        super().__init__(rng, params)
        self.blocks = params.prefix_blocks
        self.load_factor = params.load_factor

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        head = ctx.block_hashes[: self.blocks]
        if not head:
            self.reason = "short_prompt"
            return by_load(candidates)
        self.reason = "prefix_hash"
        ring = rendezvous(struct.pack(f"<{len(head)}Q", *head), candidates)
        if self.load_factor <= 0:
            return ring
        bound = math.ceil(self.load_factor * (sum(w.load for w in candidates) + 1) / len(candidates))
        for i, w in enumerate(ring):
            if w.load < bound:
                if i:
                    self.reason = "prefix_hash_bounded"
                return [w, *ring[:i], *ring[i + 1:]]
        return ring
