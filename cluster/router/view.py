"""The router's view of the cluster: workers, their load as the engines report it, health, breakers.

Load arrives over each engine's push feed (``cluster.router.feed``), never by polling per request.
``inflight`` and ``pending_blocks`` are the router's own real-time additions on top of the last report.
A worker is eligible when it is healthy (a feed frame within ``health_timeout_s``), not draining, and
its circuit breaker is closed (or half-open and due for a trial).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NewType, Protocol

WorkerId = NewType("WorkerId", str)

STREAM_KEY = "kvmesh_stream"
"""Where a request keeps its client stream once it has begun (so a deadline can still end it properly)."""


@dataclass
class Breaker:
    """Opens after ``threshold`` consecutive failures; after ``cooldown_s`` one trial request may pass."""

    threshold: int = 3
    cooldown_s: float = 5.0
    failures: int = 0
    opened_at: float | None = None

    def allows(self, now: float) -> bool:
        return self.opened_at is None or now - self.opened_at >= self.cooldown_s

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None

    def failure(self, now: float) -> bool:
        """Record a failure; True when this failure opened the breaker."""
        self.failures += 1
        if self.failures >= self.threshold:
            was_closed = self.opened_at is None
            self.opened_at = now
            return was_closed
        return False

    @property
    def state(self) -> str:
        return "closed" if self.opened_at is None else "open"


@dataclass
class WorkerInfo:
    name: WorkerId
    url: str
    role: str = "colocated"
    region: str = "local"
    node: str = ""
    model: str = ""
    hardware: str = ""
    tp: int = 1
    vocab_size: int = 32000
    block_size: int = 16
    # Reported by the engine's feed.
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    free_blocks: int = 0
    num_blocks: int = 0
    prefill_backlog_tokens: int = 0
    lag_p99_ms: float = 0.0
    draining: bool = False
    last_seen: float = 0.0
    feed_connected: bool = False
    # The router's own real-time view.
    inflight: int = 0
    sent: int = 0
    pending_blocks: int = 0
    prefilling_blocks: int = 0
    """Prompt blocks this router sent the worker whose first token it has not seen yet: exact and current,
    where the reported backlog is up to a beat old and misses requests still on the wire."""
    breaker: Breaker = field(default_factory=Breaker)
    extra: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def from_launch(name: str, d: dict[str, Any]) -> WorkerInfo:
        return WorkerInfo(WorkerId(name), d["url"], d.get("role", "colocated"), d.get("region", "local"),
                          d.get("node", ""), d.get("model", ""), d.get("hardware", ""), int(d.get("tp", 1)),
                          int(d.get("vocab_size", 32000)), int(d.get("block_size", 16)),
                          num_blocks=int(d.get("num_blocks", 0)), free_blocks=int(d.get("num_blocks", 0)),
                          extra={k: d[k] for k in ("kv_address", "feed_url") if k in d})

    def update_load(self, load: dict[str, Any], now: float) -> None:
        self.running = int(load.get("running", 0))
        self.waiting = int(load.get("waiting", 0))
        self.kv_usage = float(load.get("kv_usage", 0.0))
        self.free_blocks = int(load.get("free_blocks", 0))
        self.prefill_backlog_tokens = int(load.get("prefill_backlog_tokens", 0))
        self.num_blocks = int(load.get("num_blocks", self.num_blocks))
        self.lag_p99_ms = float(load.get("lag_p99_ms", 0.0))
        self.draining = bool(load.get("draining", False))
        self.last_seen = now
        self.pending_blocks = 0  # the report now includes what the router had sent

    @property
    def used_blocks(self) -> int:
        return max(0, self.num_blocks - self.free_blocks)

    @property
    def load(self) -> int:
        """Requests on the worker as the router best knows: its own open ones, or the engine's count."""
        return max(self.inflight, self.running + self.waiting)


class WorkerTiming(Protocol):
    """A worker's step times as the router estimates them (``cluster.router.timing.CostModelTiming``)."""

    def block_ms(self, w: WorkerInfo) -> float | None:
        """Emulated ms to prefill one KV block on ``w`` (None: unknown)."""
        ...

    def decode_step_ms(self, w: WorkerInfo, seqs: int, context_tokens: int) -> float | None:
        """Emulated ms of one decode step of ``seqs`` sequences holding ``context_tokens`` in all (None: unknown)."""
        ...


@dataclass(frozen=True)
class RoutingConfig:
    health_timeout_s: float = 2.0
    """A worker whose feed is silent this long is unhealthy (the feed beats every ``FeedSpec.heartbeat_ms``,
    one beat per process: ``cluster.router.feed``)."""
    require_feed: bool = True
    """Without a feed (an engine that is not kvmesh), health rests on request outcomes alone."""


class ClusterView:
    """Workers by name; joins and leaves at run time. ``timing``: the workers' step times as the router
    estimates them (``cluster.router.timing``; None: unknown, policies that price time leave it out)."""

    def __init__(self, workers: list[WorkerInfo], cfg: RoutingConfig | None = None,
                 now: Callable[[], float] = time.monotonic, timing: WorkerTiming | None = None) -> None:
        self.cfg = cfg or RoutingConfig()
        self.now = now
        self.timing = timing
        self.workers: dict[WorkerId, WorkerInfo] = {w.name: w for w in workers}
        self._models: frozenset[str] | None = None

    def add(self, w: WorkerInfo) -> None:
        self.workers[w.name] = w
        self._models = None

    def remove(self, name: WorkerId) -> WorkerInfo | None:
        self._models = None
        return self.workers.pop(name, None)

    def healthy(self, w: WorkerInfo) -> bool:
        if w.draining:
            return False
        if self.cfg.require_feed:
            return w.feed_connected and self.now() - w.last_seen <= self.cfg.health_timeout_s
        return True

    def eligible(self, w: WorkerInfo) -> bool:
        return self.healthy(w) and w.breaker.allows(self.now())

    def models(self) -> list[str]:
        return sorted(self.model_set())

    def model_set(self) -> frozenset[str]:
        """The models some worker serves (cached; joins and leaves reset it)."""
        if self._models is None:
            self._models = frozenset(w.model for w in self.workers.values() if w.model)
        return self._models

    def by_role(self, role: str) -> list[WorkerInfo]:
        return sorted((w for w in self.workers.values() if w.role == role), key=lambda w: w.name)


@dataclass
class RequestContext:
    """What a policy may look at. Token ids, block hashes and overlaps are filled in by the router."""

    body: dict[str, Any]
    session_id: str | None = None
    origin_region: str | None = None
    residency: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    overlap: dict[WorkerId, int] = field(default_factory=dict)
    tier_hits: dict[WorkerId, int] = field(default_factory=dict)
    """Blocks past ``overlap`` a worker could load from its CPU or disk tier or its region's KV store."""
    tier_load_blocks: dict[WorkerId, float] = field(default_factory=dict)
    """What loading ``tier_hits`` costs, in prefill blocks (``cluster.router.tiers.TierPricing``)."""
    text: str = ""
    """The prompt as routing text (what text-based policies such as SGLang's cache_aware match on)."""
    inflight_ticket: int | None = None
    """The in-flight prefix entry of the current attempt (``prefix_index.InflightPrefixes``)."""
    counted_tokens: int | None = None
    """The prompt's length when it was ranked before it was all tokenized (``Chooser.prepare``'s head path):
    ``num_tokens`` and ``num_blocks`` until ``prompt_ids`` and ``block_hashes`` are filled in."""
    counted_blocks: int | None = None
    tail: Callable[[], None] | None = None
    """Tokenizes the rest of the prompt and makes the in-flight record (``Chooser.complete``); None once done."""
    routed_to: WorkerId | None = None
    """The worker of the current attempt, for the in-flight record ``tail`` makes."""

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes) if self.counted_blocks is None else self.counted_blocks

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) if self.counted_tokens is None else self.counted_tokens
