"""A cluster spec's engines, tiers, KV stores and router choice in one process, on jumping virtual time.

``VirtualCluster`` builds every engine of a ``ClusterSpec`` as the workers do (``build_engine``: the same
config, cost model, KV blocks and tier chain), gives them their region's KV store when the spec has one (a
``StoreServer`` over the in-process transport, the engines' ``StoreTier`` written through and read back, as
in a launched cluster), and routes each request with the router's own ``Chooser`` and policy, whose prefix
index the engines' KV events feed (media included). What it leaves out is the HTTP and Ray plumbing, and
with it every wall-clock wait: ``JumpClock`` runs all the engines' step loops and tier loads concurrently,
and whenever nothing can run it jumps to the next deadline, so a 600 s trace replays in minutes of CPU and
no step is ever late (step lag 0 by construction). Use it for figures that depend on scheduling, caching and
routing (prefix hit ratios, preemptions, emulated TTFT), not on the serving stack's own overheads.

Router bookkeeping follows ``cluster.router``: each engine's load report is read at every decision (a
perfect feed), ``inflight`` and ``prefilling_blocks`` are the router's own counts, cleared at the first
token. A request the engine refuses (longer than its context) is recorded as refused, not served.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from actors.engine.engine import Engine, EngineError
from actors.engine.factory import build_engine
from actors.feed import encode_events
from actors.jump_clock import JumpClock
from actors.kvstore.client import StoreTier
from actors.kvstore.engine_side import attach_store
from actors.kvstore.server import StoreServer
from actors.kvstore.store import BlockStore, Changes
from cluster.router.app import default_prefill_estimate
from cluster.router.choice import Chooser, RoutedRequest
from cluster.router.regions import Topology
from cluster.router.tiers import catalog_pricing
from cluster.router.timing import CostModelTiming
from cluster.router.view import ClusterView, RequestContext, WorkerId, WorkerInfo
from config import default_catalog
from config.cluster import ClusterSpec, RouterSpec
from transport import Site
from transport.inproc import InprocHub, InprocTransport


@dataclass
class SimRecord:
    request_id: str
    engine: str
    arrival_ms: float
    prompt_tokens: int
    output_tokens: int = 0
    first_token_ms: float | None = None
    end_ms: float | None = None
    refused: str | None = None

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_ms is None else self.first_token_ms - self.arrival_ms


class _Index:
    """A store server's change log as the engines' ``IndexSource`` (a direct call: same process)."""

    def __init__(self, server: StoreServer) -> None:
        self.server = server

    async def changes_since(self, since: int) -> Changes:
        return self.server.changes_since(since)


class VirtualCluster:
    """The engines, stores and router choice of ``spec`` on one ``JumpClock`` (see the module docstring)."""

    def __init__(self, spec: ClusterSpec, clock: JumpClock, *, policy: str | None = None, seed: int = 0) -> None:
        self.spec = spec
        self.clock = clock
        self.engines: dict[str, Engine] = {}
        self.stores: dict[str, StoreServer] = {}
        self._hub = InprocHub()
        self._transports: list[InprocTransport] = []
        workers: list[WorkerInfo] = []
        self._instances = spec.engines()
        for inst in self._instances:
            cfg, cost = build_engine(inst, spec.transport.kv_payload_scale)
            self.engines[inst.name] = Engine(cfg, cost, clock)
            workers.append(WorkerInfo(WorkerId(inst.name), f"virtual://{inst.name}", role=inst.role,
                                      region=inst.region, node=inst.node, model=cfg.model_name,
                                      hardware=inst.hardware.name, tp=inst.tp, vocab_size=cfg.vocab_size,
                                      block_size=cfg.block_size, num_blocks=cfg.num_blocks,
                                      free_blocks=cfg.num_blocks, feed_connected=True))
        router_spec: RouterSpec = spec.router.model_copy(update={"policy": policy}) if policy else spec.router
        timing = CostModelTiming()
        self.view = ClusterView(workers, now=lambda: clock.now_ms() / 1000.0, timing=timing)
        estimate = default_prefill_estimate(timing)
        link = (spec.kv_store.link if spec.kv_store is not None else None) or spec.transport.intra_region_link
        self.chooser = Chooser(router_spec, self.view, Topology(), estimate, random.Random(seed),
                               catalog_pricing(estimate, link))
        for name, eng in self.engines.items():
            self.chooser.index.apply_snapshot(WorkerId(name), 0, [])
            eng.kv_subscribers.append(self._feed(WorkerId(name)))

    def _feed(self, worker: WorkerId) -> Any:
        def on_events(seq: int, events: list[Any]) -> None:
            self.chooser.index.apply(worker, seq, encode_events(events))
        return on_events

    async def start(self) -> None:
        """Start the stores (one per region), attach them to the engines, start the engines."""
        cfg = self.spec.kv_store
        if cfg is not None:
            scale = self.spec.transport.kv_payload_scale
            link = default_catalog().links.get(cfg.link or self.spec.transport.intra_region_link)
            for region in {i.region for i in self._instances}:
                server = StoreServer(BlockStore(max(1, int(cfg.capacity_gb * 1e9 * scale)), cfg.eviction),
                                     InprocTransport(Site(f"store-{region}", region), self.clock, hub=self._hub),
                                     timeout_ms=cfg.timeout_ms)
                addr = await server.start()
                self.stores[region] = server
                for inst in self._instances:
                    if inst.region != region:
                        continue
                    t = InprocTransport(Site(inst.node, region), self.clock, hub=self._hub)
                    self._transports.append(t)
                    attach_store(self.engines[inst.name],
                                 StoreTier(t, [(addr, _Index(server))], link, payload_scale=scale,
                                           timeout_ms=cfg.timeout_ms, sync_interval_ms=cfg.sync_interval_ms,
                                           max_put_inflight=cfg.max_put_inflight))
        for eng in self.engines.values():
            eng.start()

    async def serve(self, request_id: str, arrival_ms: float, make_prompt: Callable[[], list[int]],
                    max_tokens: int) -> SimRecord:
        """Route and run one request arriving at ``arrival_ms`` (its prompt made then, not held before);
        returns when it finished."""
        await self.clock.sleep_until(arrival_ms)
        prompt = make_prompt()
        now = self.clock.now_ms()
        for w in self.view.workers.values():
            w.update_load(self.engines[w.name].load(), now / 1000.0)
        model = next(iter(self.view.workers.values())).model
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
        ctx = RequestContext(body)
        pool = self.chooser.eligible(model, None)
        policy = self.chooser.policy
        self.chooser.prepare(policy, ctx, RoutedRequest.of(body, chat=False), pool)
        worker = self.chooser.rank(policy, pool, ctx)[0]
        self.chooser.routed(policy, worker, ctx)
        new_blocks = max(0, ctx.num_blocks - ctx.overlap.get(worker.name, 0))
        worker.inflight += 1
        worker.prefilling_blocks += new_blocks
        rec = SimRecord(request_id, worker.name, arrival_ms, len(prompt))
        try:
            stream = self.engines[worker.name].submit(prompt, max_tokens, ignore_eos=True, request_id=request_id,
                                                      arrival_ms=arrival_ms)
            async for ev in stream:
                if ev.token_ids and rec.first_token_ms is None:
                    rec.first_token_ms = ev.time_ms
                    worker.prefilling_blocks -= new_blocks
                    new_blocks = 0
                rec.output_tokens += len(ev.token_ids)
            rec.end_ms = self.clock.now_ms()
        except EngineError as e:
            rec.refused = str(e)
        finally:
            worker.inflight -= 1
            worker.prefilling_blocks -= new_blocks
        return rec

    async def replay(self, requests: Sequence[tuple[str, float, Callable[[], list[int]], int]]) -> list[SimRecord]:
        """Every (request id, arrival ms, prompt maker, max tokens) at its arrival; the records in input order."""
        return list(await asyncio.gather(*(self.serve(*r) for r in requests)))

    def counters(self) -> dict[str, float]:
        """Prefix queries and hits (GPU and lower tiers, tokens), preemptions, steps, GPU busy ms and the connector's
        share of it (``actors.engine.tiers.overhead``), tier loads and fallbacks."""
        out = dict.fromkeys(("prefix_queries", "gpu_hits", "tier_hits", "preemptions", "steps", "tier_loads",
                             "tier_fallbacks", "swaps_out"), 0.0)
        for eng in self.engines.values():
            st = eng.scheduler.stats
            out["prefix_queries"] += st.prefix_queries
            out["gpu_hits"] += st.prefix_hits
            out["preemptions"] += st.preemptions
            out["steps"] += eng.steps
            out["busy_ms"] = out.get("busy_ms", 0.0) + eng.busy_ms
            out["connector_ms"] = out.get("connector_ms", 0.0) + float(getattr(eng.cost, "connector_ms", 0.0))
            if eng.tiers is not None:
                c = eng.tiers.counters
                out["tier_hits"] += c.external_hits
                out["tier_loads"] += c.loads
                out["tier_fallbacks"] += c.fallbacks
                out["swaps_out"] += c.swaps_out
        for s in self.stores.values():
            out["store_blocks"] = out.get("store_blocks", 0.0) + len(s.store)
            out["store_evictions"] = out.get("store_evictions", 0.0) + s.store.evictions
        return out

    async def close(self) -> None:
        for eng in self.engines.values():
            await eng.stop()
        for s in self.stores.values():
            await s.close()
        for t in self._transports:
            await t.close()
