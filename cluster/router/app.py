"""The router: OpenAI API in, the chosen engine's response streamed straight back out.

A request walks down through small parts, each testable alone:
1. admission (here): parse and validate the body (the same 400s an engine gives, without bothering one);
   the eligible pool (``Chooser.eligible``; none: a 503 that says why, naming the residency region when
   the request has one); every eligible worker saturated (``max_waiting`` queued): a 429 with
   ``Retry-After``;
2. choice (``choice.Chooser``): the prefix when the policy or region strategy needs it, then the region
   strategy's ranking with the policy inside it (``X-Route-Policy`` may override the policy);
3. the flow: disaggregated (``disagg.DisaggFlow``) when the cluster has prefill and decode engines and the
   request is worth splitting, else colocated (``proxy.ColocatedFlow``): attempts, retries, relay, migration;
4. the deadline (``deadlines.DeadlineSweeper``): a request past ``request_timeout_s`` ends with a 504, or
   with an error event and ``[DONE]`` on a stream already begun, so the client is never left waiting.
5. a graceful stop (``end_requests``, a router restart): new requests get a 503 with ``Retry-After``, and
   every request in flight ends at once the same way as at its deadline, with a 503 (an OpenAI-style error
   event ``data: {"error": {...}}`` then ``[DONE]`` on a begun stream, as vLLM ends a failed stream); its
   engine's connection is closed, which aborts the request there.

The router's HTTP server is aiohttp (``web``); its client to the engines is behind the ``Upstream``
interface (aiohttp in production, fakes in unit tests); time is the router's clock (emulated ms).
Everything is counted in Prometheus metrics (loop-local counters, ``metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import generate_latest

from actors.clock import Clock
from actors.openai_api import ApiError, parse_json_object
from cluster.router.attempt import Attempts, RouterClock
from cluster.router.choice import Chooser, RoutedRequest
from cluster.router.deadlines import DeadlineSweeper
from cluster.router.disagg import DisaggFlow
from cluster.router.exchange import Call, ClientStream, Whole, json_error, json_whole
from cluster.router.feed import FeedClient
from cluster.router.metrics import RouterMetrics
from cluster.router.migration import KVMigrator
from cluster.router.proxy import DISCONNECTS, ColocatedFlow, Proxied
from cluster.router.regions import PrefillEstimate, Topology
from cluster.router.relay import Relay, StreamState
from cluster.router.tiers import catalog_pricing
from cluster.router.timing import CostModelTiming, WorkerTiming
from cluster.router.upstream import AiohttpUpstream, Upstream, UpstreamLimits
from cluster.router.view import ClusterView, RequestContext, RoutingConfig, WorkerId, WorkerInfo
from config.cluster import ClusterSpec, DisaggSpec, RouterSpec

SHUTTING_DOWN = "the router is shutting down (restart): send the request again"
WARM_CONNECTIONS = 2
"""Connections opened to each engine at start: the first requests of a run rarely overlap more on one engine."""


@dataclass(frozen=True)
class RouterSite:
    """Where a router runs (facts of the cluster, not router settings)."""

    topology: Topology = field(default_factory=Topology)
    disagg: DisaggSpec | None = None
    """How to serve through prefill and decode engines, when the cluster has them."""
    residency_zone: str | None = None
    """A router partitioned to one residency zone sees only that region's workers."""
    store_link: str = "rdma-ib-ndr400"
    """Link preset between an engine and its region's KV store (prices store hits: ``cluster.router.tiers``)."""

    @staticmethod
    def of(spec: ClusterSpec, residency_zone: str | None = None) -> RouterSite:
        regions = [r.name for r in spec.regions]
        rtt = {(a, b): spec.rtt_ms(a, b) for i, a in enumerate(regions) for b in regions[i + 1:]}
        store = spec.kv_store.link if spec.kv_store is not None else None
        return RouterSite(Topology(rtt), spec.disagg if spec.disaggregated else None, residency_zone,
                          store or spec.transport.intra_region_link)


class RouterServer:
    def __init__(self, workers: list[WorkerInfo], spec: RouterSpec | None = None, *,
                 site: RouterSite | None = None, clock: RouterClock | None = None,
                 rng: random.Random | None = None, upstream: Upstream | None = None,
                 prefill_ms: PrefillEstimate | None = None, timing: WorkerTiming | None = None) -> None:
        self.spec = spec = spec or RouterSpec()
        self.site = site = site or RouterSite()
        self.clock: RouterClock = clock or Clock(1.0, spin_ms=0)
        self.region = site.residency_zone or spec.region
        if site.residency_zone is not None:
            workers = [w for w in workers if w.region == site.residency_zone]
        self.metrics = RouterMetrics()
        self.attempts = Attempts(self.metrics, site.topology, self.clock)
        timing = timing if timing is not None else CostModelTiming()
        self.view = ClusterView(workers, RoutingConfig(health_timeout_s=spec.health_timeout_s,
                                                       require_feed=spec.index_mode == "events"),
                                self.attempts.wall_now, timing)
        for w in workers:
            w.breaker.threshold, w.breaker.cooldown_s = spec.breaker_threshold, spec.breaker_cooldown_s
        # one roofline cache for the view's wait term and the prefill estimate (built once, warmed once)
        estimate = prefill_ms or default_prefill_estimate(timing if isinstance(timing, CostModelTiming) else None)
        self.chooser = Chooser(spec, self.view, site.topology, estimate, rng or random.Random(0),
                               catalog_pricing(estimate, site.store_link))
        ts = self.clock.time_scale
        self.upstream: Upstream = upstream or AiohttpUpstream(UpstreamLimits(
            connect_timeout_s=spec.connect_timeout_s, read_timeout_s=spec.read_timeout_s * ts,
            connections=spec.upstream_connections))
        self.relay = Relay(self.upstream, self.attempts, self.metrics)
        self.kv_migrator = KVMigrator(spec.kv_migration, self.chooser, self.attempts, self.relay, self.upstream,
                                      self.metrics.registry)
        self.colocated = ColocatedFlow(self.chooser, self.attempts, self.relay, self.upstream, self.metrics,
                                       max_attempts=spec.max_attempts, migrate=spec.migrate, kv=self.kv_migrator)
        roles = {w.role for w in self.view.workers.values()}
        self.disagg = (DisaggFlow(site.disagg, self.chooser, self.attempts, self.relay, self.upstream,
                                  self.metrics.registry, max_attempts=spec.max_attempts, kv=self.kv_migrator)
                       if site.disagg is not None and {"prefill", "decode"} <= roles else None)
        self.deadlines = DeadlineSweeper(self.clock, spec.request_timeout_s * 1000.0)
        self.feeds: dict[str, FeedClient] = {}
        """By feed URL: one connection per engine process (workers launched together share one)."""
        self._feed_of: dict[WorkerId, str] = {}
        self._feed_session: Any = None
        self._warming: set[asyncio.Task[int]] = set()
        self.closing = False
        """A graceful stop began: requests are refused, those in flight ended (``end_requests``)."""

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start_mechanism(self) -> None:
        """Feeds, the deadline sweeper and warm connections to every engine (the HTTP server is
        ``web.RouterHTTP``'s)."""
        if self.spec.index_mode == "events":
            for w in self.view.workers.values():
                await self._start_feed(w)
        self.deadlines.start()
        for w in self.view.workers.values():
            self._warm(w)

    def _warm(self, w: WorkerInfo) -> None:
        """Open ``WARM_CONNECTIONS`` pooled connections to a worker in the background, so a run's first
        requests (its first cache misses) do not pay the connect (``Upstream.warm``)."""
        task = asyncio.get_running_loop().create_task(self.upstream.warm(w.url, WARM_CONNECTIONS),
                                                      name=f"warm-{w.name}")
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    async def stop_mechanism(self) -> None:
        for task in list(self._warming):
            task.cancel()
        if self._warming:
            await asyncio.wait(list(self._warming))
        await self.deadlines.stop()
        await self.kv_migrator.close()
        for f in list(self.feeds.values()):
            await f.stop()
        self.feeds.clear()
        self._feed_of.clear()
        if self._feed_session is not None:
            await self._feed_session.close()
            self._feed_session = None
        await self.upstream.close()

    async def end_requests(self, wait_s: float = 10.0) -> int:
        """Graceful stop: refuse new requests and end every one in flight with a 503 (an error event and
        ``[DONE]`` on a begun stream); wait up to ``wait_s`` wall seconds for their handlers to finish.
        Returns how many were ended."""
        self.closing = True
        ended = self.deadlines.end_all()
        if ended:
            await asyncio.wait(ended, timeout=wait_s)
        return len(ended)

    async def _start_feed(self, w: WorkerInfo) -> None:
        import aiohttp  # feeds are WebSockets: their own session, without the proxy's read timeout

        if self._feed_session is None:
            # No connection cap: each feed holds its WebSocket for good (aiohttp's default 100 would leave
            # the 101st process, or engine with per_actor off, unconnected and so unhealthy).
            self._feed_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        url = str(w.extra.get("feed_url") or w.url)
        self._feed_of[w.name] = url
        feed = self.feeds.get(url)
        if feed is None:
            on_frame = self.kv_migrator.on_frame if self.kv_migrator.enabled else None
            feed = self.feeds[url] = FeedClient(url, self.chooser.index, self._feed_session, self.view.now,
                                                on_frame=on_frame)
            await feed.add(w)
            feed.start()
        else:
            await feed.add(w)

    # -- membership --------------------------------------------------------------------------------
    async def add_worker(self, call: Call) -> Whole:
        try:
            d = parse_json_object(call.body)
            w = WorkerInfo.from_launch(str(d["name"]), d)
        except (ApiError, ValueError, KeyError, TypeError) as e:
            return json_error(400, f"a worker needs at least 'name' and 'url': {e}")
        zone = self.site.residency_zone
        if zone is not None and w.region != zone:
            return json_error(400, f"this router serves residency zone {zone!r} only")
        if w.name in self.view.workers:
            await self._drop(w.name)
        w.breaker.threshold, w.breaker.cooldown_s = self.spec.breaker_threshold, self.spec.breaker_cooldown_s
        self.view.add(w)
        if self.spec.index_mode == "events":
            await self._start_feed(w)
        self._warm(w)
        return json_whole({"added": w.name})

    async def remove_worker(self, call: Call) -> Whole:
        name = WorkerId(call.match.get("name", ""))
        if name not in self.view.workers:
            return json_error(404, f"no worker {name!r}")
        await self._drop(name)
        return json_whole({"removed": name})

    async def _drop(self, name: WorkerId) -> None:
        url = self._feed_of.pop(name, None)
        feed = self.feeds.get(url) if url is not None else None
        if feed is not None:
            await feed.remove(name)
            if not feed.workers:
                del self.feeds[feed.url]
                await feed.stop()
        self.view.remove(name)
        self.chooser.drop_worker(name)

    # -- simple endpoints --------------------------------------------------------------------------
    async def health(self, call: Call) -> Whole:
        if not any(self.view.eligible(w) for w in self.view.workers.values()):
            return json_error(503, "no eligible worker")
        return Whole(200)

    async def models(self, call: Call) -> Whole:
        now = int(time.time())
        return json_whole({"object": "list", "data": [
            {"id": m, "object": "model", "created": now, "owned_by": "kvmesh", "root": m, "parent": None}
            for m in self.view.models()]})

    async def list_workers(self, call: Call) -> Whole:
        return json_whole([{
            "name": w.name, "url": w.url, "process": str(w.extra.get("feed_url") or w.url), "role": w.role,
            "region": w.region, "node": w.node, "model": w.model,
            "hardware": w.hardware, "inflight": w.inflight, "sent": w.sent, "running": w.running,
            "waiting": w.waiting, "kv_usage": w.kv_usage, "free_blocks": w.free_blocks,
            "num_blocks": w.num_blocks, "prefill_backlog_tokens": w.prefill_backlog_tokens,
            "prefilling_blocks": w.prefilling_blocks, "lag_p99_ms": w.lag_p99_ms, "healthy": self.view.healthy(w),
            "eligible": self.view.eligible(w), "breaker": w.breaker.state, "feed": w.feed_connected,
            "indexed_blocks": self.chooser.index.blocks_of(w.name)} for w in self.view.workers.values()])

    async def prometheus(self, call: Call) -> Whole:
        m = self.metrics
        for w in self.view.workers.values():
            lv = (w.name, w.region)
            m.w_inflight.labels(*lv).set(w.inflight)
            m.w_running.labels(*lv).set(w.running)
            m.w_waiting.labels(*lv).set(w.waiting)
            m.w_kv.labels(*lv).set(w.kv_usage)
            m.w_healthy.labels(*lv).set(1 if self.view.eligible(w) else 0)
        return Whole(200, generate_latest(m.registry), {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # -- routing -----------------------------------------------------------------------------------
    async def completions(self, call: Call, out: ClientStream) -> Whole | None:
        return await self.route(call, out, chat=False)

    async def chat_completions(self, call: Call, out: ClientStream) -> Whole | None:
        return await self.route(call, out, chat=True)

    async def route(self, call: Call, out: ClientStream, chat: bool) -> Whole | None:
        """Route one request within its deadline (see the module docstring)."""
        task = asyncio.current_task()
        assert task is not None
        self.deadlines.track(task)
        try:
            return await self._admit(call, out, chat)
        except asyncio.CancelledError:
            if self.deadlines.ended(task):
                status, msg = 503, SHUTTING_DOWN
            elif self.deadlines.expired(task):
                status, msg = 504, f"request exceeded the router's deadline of {self.spec.request_timeout_s:g} s"
            else:
                raise
            task.uncancel()
            self.metrics.responses.inc_labels(str(status))
            if out.started:
                with contextlib.suppress(*DISCONNECTS):
                    await self.relay.fail(out, status, msg)
                return None
            return json_error(status, msg, {"Retry-After": "1"} if status == 503 else None)
        finally:
            self.deadlines.forget(task)

    def _refuse(self, status: int, message: str, headers: dict[str, str] | None = None) -> Whole:
        self.metrics.responses.inc_labels(str(status))
        return json_error(status, message, headers)

    async def _admit(self, call: Call, out: ClientStream, chat: bool) -> Whole | None:
        t0 = time.perf_counter()
        if self.closing:
            return self._refuse(503, SHUTTING_DOWN, {"Retry-After": "1"})
        try:
            body: dict[str, Any] = parse_json_object(call.body)
            policy = self.chooser.policy_for(call.headers.get("X-Route-Policy"))
            req = RoutedRequest.of(body, chat)
        except ApiError as e:
            return self._refuse(e.status, e.message)
        residency = call.headers.get("X-Residency") or body.get("residency")
        origin = call.headers.get("X-Region") or body.get("region") or self.region
        session = call.headers.get("X-Session-Id") or body.get("session_id")
        if residency is not None and not isinstance(residency, str):
            return self._refuse(400, "'residency' must be a region name")
        if req.model is not None and req.model not in self.view.model_set():
            return self._refuse(404, f"The model `{req.model}` does not exist.")
        pool = self.chooser.eligible(req.model, residency)
        if not pool:
            if residency is not None:
                self.metrics.residency_rejections.inc_labels(residency)
                return self._refuse(503, f"no eligible worker in residency region {residency!r}; data residency "
                                         "forbids serving this request anywhere else", {"Retry-After": "1"})
            return self._refuse(503, "no healthy worker can serve this request", {"Retry-After": "1"})
        limit = self.spec.max_waiting
        if limit is not None and all(w.waiting >= limit for w in pool):
            self.metrics.saturated.inc()
            return self._refuse(429, f"every eligible worker has {limit} or more requests waiting",
                                {"Retry-After": "1"})
        ctx = RequestContext(body, session if isinstance(session, str) else None,
                             origin if isinstance(origin, str) else None, residency)
        self.chooser.prepare(policy, ctx, req, pool, defer_tail=self.disagg is None)
        ranked = self.chooser.rank(policy, pool, ctx)
        self.metrics.latency.observe(time.perf_counter() - t0)
        self.metrics.decisions.inc_labels(policy.name, policy.reason)
        st = StreamState(chat, req.include_usage, req.max_tokens)
        if self.disagg is not None:
            plan = self.disagg.decide(policy, req, ctx)
            if plan.reason == "disaggregated":
                whole = await self.disagg.serve(plan, call.headers.get("X-Request-Id"), req, ctx, st, out)
                self.metrics.responses.inc_labels(str(whole.status) if whole is not None else "200")
                return whole
        return await self.colocated.serve(Proxied(call, req, ctx, st, out, policy), ranked)

    def stats(self) -> dict[str, Any]:
        return {w.name: {"inflight": w.inflight, "sent": w.sent} for w in self.view.workers.values()}


def default_prefill_estimate(timing: CostModelTiming | None = None) -> Callable[[WorkerInfo, int, int], float]:
    """Prefill time of a worker from its roofline cost model (catalog presets, ``timing.CostModelTiming``; pass
    the view's own to share its memo); a worker type the catalog does not know gets a nominal 10k tokens per
    ms, so distance dominates."""
    timing = timing if timing is not None else CostModelTiming()

    def est(w: WorkerInfo, new: int, cached: int) -> float:
        ms = timing.prefill_ms(w, new, cached)
        return new / 10_000.0 if ms is None else ms

    return est
