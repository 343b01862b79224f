"""The GPU worker: a Ray actor standing in for one GPU (or, with ``gpus_per_actor``, several).

It builds its engines from the cluster spec, runs each engine's step loop and its own HTTP server on
its event loop, and answers the driver's control calls (start, load, drain, stop). Per-token traffic
never crosses Ray: clients talk HTTP to the engines directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from typing import Any

from actors.clock import Clock
from actors.engine.engine import Engine
from actors.engine.factory import build_engine
from actors.feed import FeedDisturbance, FeedHub
from actors.host_server import HostServer
from actors.kv_connector import KVConnector, address_to_json
from actors.kvstore.engine_side import StoreLink, Stores
from actors.metrics import EngineMetrics
from actors.migration import MigrationAgent
from actors.server import EngineServer
from config.cluster import ClusterSpec
from config.manifest import refusal
from transport import FaultPlan, Site, Topology, TransportOptions, make_transport
from transport.faulty import FaultyTransport


def advertise_host(host: str) -> str | None:
    """The address peers dial for servers bound to ``host``: this node's own when ``host`` is a wildcard."""
    import ipaddress

    if not ipaddress.ip_address(host).is_unspecified:
        return None
    import ray

    return str(ray.util.get_node_ip_address())


def restore_priority(nice: int = 0) -> None:
    """Set this process's niceness to ``nice`` where allowed, else undo the niceness Ray gives its workers.

    Ray starts workers at niceness 15 (``launch`` asks it for 0). An emulated GPU must wake on time: at nice 15
    a busy load generator or router at nice 0 on the same host takes nearly all the CPU and the engines' step
    lag explodes; below 0 (``ClusterSpec.engine_nice``) the engines go ahead of them. Lowering the niceness
    needs root or CAP_SYS_NICE: without it this falls back to 0, and without that to what Ray gave.

    Linux keeps a niceness per thread (``PRIO_PROCESS`` names a thread id), and Ray runs an async actor's loop
    on a thread of its own: every thread of the process is set (later threads inherit their creator's).
    """
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for value in dict.fromkeys((nice, 0)):
        try:
            for tid in threads:
                with contextlib.suppress(ProcessLookupError):  # a thread that has ended
                    os.setpriority(os.PRIO_PROCESS, tid, value)
            return
        except OSError:
            continue


def claim_realtime(priority: int = 1) -> bool:
    """Put every thread of this process under ``SCHED_RR`` at ``priority`` (threads started later inherit it);
    False where the host does not allow it (no root or CAP_SYS_NICE, not Linux), leaving the threads as they were."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
        param = os.sched_param(priority)
        for tid in threads:
            with contextlib.suppress(ProcessLookupError):  # a thread that has ended
                os.sched_setscheduler(tid, os.SCHED_RR, param)
    except (OSError, AttributeError):
        return False
    return True


def freeze_heap() -> None:
    """Take everything allocated so far out of the cyclic collector's sight (``gc.freeze``).

    An actor starts with ~90,000 tracked objects (Ray, pydantic, the catalog) and an engine adds its block
    tables. A full collection over that heap took 75-100 ms on a small host, on the event loop thread: a stall
    every few thousand requests that showed as a 100 ms p99 in the router at concurrency 32 and as step lag in
    the engines. Frozen, a full collection scans only what came later (measured: 2 ms). Objects made after
    this call are collected as usual.
    """
    gc.collect()
    gc.freeze()


class GpuWorker:
    """Hosts the named engines of ``spec`` (wrapped with ``ray.remote`` by the launcher).

    Layout (``spec.engine_server``): ``shared`` (default) serves every engine here on one port by path
    (``actors.host_server``), ``per_engine`` gives each engine a server and port of its own (the old layout,
    kept as a benchmark baseline). Either way the engines share this process's event loop, clock (one timer
    for all their steps) and feed, and stay independent otherwise (scheduler, KV cache, metrics, transport).
    ``kill_engines`` ends one engine as its death would while the others go on.
    """

    def __init__(self, spec_json: str, engine_names: list[str], host: str = "127.0.0.1") -> None:
        self.spec = ClusterSpec.model_validate_json(spec_json)
        self._claim_cpu()
        self.names = engine_names
        self.host = host
        waker = self.spec.engine_clock
        self.clock = (Clock(self.spec.time_scale, spin_ms=0.0) if waker == "timer"
                      else Clock(self.spec.time_scale, waker=waker))
        self.engines: dict[str, Engine] = {}
        self.servers: dict[str, EngineServer] = {}
        self.connectors: dict[str, KVConnector] = {}
        self.agents: dict[str, MigrationAgent] = {}
        """Live migration and checkpoints per engine (``actors.migration``), when the spec enables them."""
        self.hub = FeedHub(self.spec.feed)
        """One feed for every engine here: a router holds one connection to this actor, not one per engine."""
        self.host_server = HostServer(self.hub, host) if self.spec.engine_server == "shared" else None
        self.killed: set[str] = set()
        self.kv_stores: Stores = {}
        """Each region's KV store actors and addresses (``attach_kv_stores``, before ``start``)."""
        self.store_link: StoreLink | None = None

    async def attach_kv_stores(self, stores: Stores) -> None:
        """The regions' shared KV stores (``actors.kvstore``): every engine started here reads and writes its
        region's store below its own tiers."""
        self.kv_stores = stores

    def _claim_cpu(self) -> None:
        """The spec's niceness for every thread here (again from the loop's thread at ``start``: threads
        started since inherit from their creator, which may not have been set)."""
        restore_priority(self.spec.engine_nice)
        if self.spec.engine_realtime:
            claim_realtime()

    async def start(self) -> dict[str, dict[str, Any]]:
        """Start every engine and its server; return each engine's URL and placement."""
        self._claim_cpu()
        by_name = {e.name: e for e in self.spec.engines()}
        out: dict[str, dict[str, Any]] = {}
        migration = self.spec.router.kv_migration
        topology = Topology.from_cluster(self.spec) if self.spec.disaggregated or migration.enabled else None
        refused: dict[str, dict[str, Any]] = {}
        for name in self.names:
            inst = by_name[name]
            if (why := refusal(self.spec.manifest, inst.group.model, inst.region)) is not None:
                # the DR manifest's start check: this engine does not start; the launcher leaves it out
                refused[name] = {"refused": why, "role": inst.role, "region": inst.region, "node": inst.node}
                continue
            cfg, cost = build_engine(inst, self.spec.transport.kv_payload_scale)
            metrics = EngineMetrics(cfg.model_name, name)
            engine = Engine(cfg, cost, self.clock, observers=[metrics])
            meta: dict[str, Any] = {"role": inst.role, "region": inst.region, "node": inst.node,
                                    "model": cfg.model_name, "hardware": inst.hardware.name, "tp": inst.tp}
            connector = None
            if topology is not None and (inst.role in ("prefill", "decode") or migration.enabled):
                # Always behind the fault wrapper (an empty plan draws nothing), so a fault schedule can
                # switch faults on and cut peers at run time.
                faults = FaultPlan.model_validate(self.spec.transport.faults or {})
                transport = make_transport(self.spec.transport, site=Site(inst.node, inst.region), clock=self.clock,
                                           topology=topology, faults=faults, options=TransportOptions(
                                               host=self.host, advertise_host=advertise_host(self.host)))
                connector = KVConnector(engine, transport, self.spec.transport.kv_payload_scale,
                                        self.spec.disagg.transfer_timeout_ms, on_record=metrics.on_transfer)
                meta["kv_address"] = address_to_json(await connector.start())
                self.connectors[name] = connector
            agent = None
            if connector is not None and migration.enabled and inst.role != "prefill":
                agent = MigrationAgent(engine, connector, metrics.registry, lease_ms=migration.lease_ms,
                                       timeout_ms=migration.transfer_timeout_ms)
                self.agents[name] = agent
            server = EngineServer(engine, metrics, host=self.host, meta=meta, connector=connector,
                                  disagg=self.spec.disagg, hub=self.hub, migration=agent,
                                  stream_interval=self.spec.stream_interval)
            if self.kv_stores and self.spec.kv_store is not None:
                if self.store_link is None:
                    self.store_link = StoreLink(self.spec, self.kv_stores, inst.node, self.host)
                self.store_link.attach(name, engine, inst.region)
            engine.start()
            if self.host_server is not None:
                self.host_server.mount(name, server)
            else:
                await server.start()
            self.engines[name] = engine
            self.servers[name] = server
            out[name] = {**meta, "num_blocks": cfg.num_blocks, "cost_model": cost.name,
                         "vocab_size": cfg.vocab_size, "block_size": cfg.block_size}
        feed_url = None
        if self.host_server is not None:
            feed_url = await self.host_server.start()  # the process's feed is at its root
        elif out:
            feed_url = next(iter(self.servers.values())).url  # every server here mounts the same hub
        for name, d in out.items():
            d["url"] = self.servers[name].url
            if self.spec.feed.per_actor:
                d["feed_url"] = feed_url
        freeze_heap()
        return {**out, **refused}

    async def load(self) -> dict[str, dict[str, Any]]:
        return {n: {**e.load(), "inflight": self.servers[n].inflight} for n, e in self.engines.items()}

    async def reset_lag(self) -> None:
        """Start a fresh step-lag window (benchmarks measure lag per load level)."""
        for e in self.engines.values():
            e.lag.reset()

    async def lag_samples(self) -> list[float]:
        """Every engine's recent step lags (wall ms) together: a cluster's p99 is taken over all its steps."""
        return [x for e in self.engines.values() for x in e.lag.samples()]

    def rss_bytes(self) -> int:
        """Resident memory of this actor process."""
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    async def drain(self, names: list[str] | None = None) -> None:
        for n in names or list(self.servers):
            self.servers[n].draining = True

    async def set_slowdown(self, names: list[str], factor: float) -> None:
        """Fault injection: the named engines' steps take ``factor`` times the modelled time (1.0 restores)."""
        if factor <= 0:
            raise ValueError("slowdown factor must be positive")
        for n in names:
            self.engines[n].slowdown = factor

    # -- fault injection (cluster.chaos) --------------------------------------------------------------
    async def partition_from_router(self, names: list[str], on: bool) -> None:
        """The named engines' HTTP and feed cut from every router (``on``), or reconnected."""
        for n in names:
            self.servers[n].partition(on)
            if on:
                self.hub.cut(n)
            else:
                self.hub.heal(n)

    def _faulty(self, name: str) -> FaultyTransport | None:
        """The fault wrapper of ``name``'s KV transport (under the link shaping: ``make_transport``)."""
        c = self.connectors.get(name)
        t: Any = c.transport if c is not None else None
        while t is not None and not isinstance(t, FaultyTransport):
            t = getattr(t, "inner", None)
        return t

    async def partition_from_peers(self, names: list[str], locations: list[str], on: bool) -> None:
        """The named engines' KV transport cut from the peers at ``locations`` (``on``), or reconnected."""
        for n in names:
            t = self._faulty(n)
            if t is not None:
                (t.cut if on else t.heal)(locations)

    async def set_transfer_faults(self, plan: dict[str, Any] | None) -> list[str]:
        """Every KV transport here injects ``plan``'s faults from now on (None: none); the engines affected."""
        parsed = FaultPlan.model_validate(plan) if plan is not None else None
        done: list[str] = []
        for n in self.connectors:
            t = self._faulty(n)
            if t is not None:
                t.switch(parsed)
                done.append(n)
        return done

    async def disturb_kv_events(self, names: list[str], loss: float, duplicate: float, reorder: float,
                                seed: int, on: bool) -> dict[str, dict[str, int]]:
        """Lose/duplicate/reorder the named engines' KV event batches (``on``) or stop; counts when stopped."""
        out: dict[str, dict[str, int]] = {}
        for i, n in enumerate(names):
            if n in self.engines:
                d = FeedDisturbance(loss, duplicate, reorder, seed + i) if on else None
                out[n] = self.hub.disturb(n, d)
        return out

    async def cached_hashes(self) -> dict[str, list[int]]:
        """Every block hash each engine's prefix cache holds (what a snapshot would tell a router)."""
        return {n: sorted(e.kv.pool.cached.keys()) for n, e in self.engines.items()}

    async def kill_engines(self, names: list[str]) -> list[str]:
        """Fault injection: end the named engines here as their death would; the others go on.

        Their clients lose their connections (no answer, no final chunk), their feed says ``gone``, their
        sequences, reservations and KV transport end. Returns the names killed now (unknown or dead: skipped).
        """
        done: list[str] = []
        for n in names:
            if n not in self.engines or n in self.killed:
                continue
            self.killed.add(n)
            if self.host_server is not None:
                self.host_server.kill(n)
            engine, server = self.engines.pop(n), self.servers.pop(n)
            await engine.stop()
            if self.host_server is None:
                await server.stop()
            agent = self.agents.pop(n, None)
            if agent is not None:
                await agent.close()
            connector = self.connectors.pop(n, None)
            if connector is not None:
                await connector.close()
            done.append(n)
        return done

    async def stop(self) -> None:
        if self.host_server is not None:
            await self.host_server.stop()
        for s in self.servers.values():
            await s.stop()
        for e in self.engines.values():
            await e.stop()
        for a in self.agents.values():
            await a.close()
        for c in self.connectors.values():
            await c.close()
        if self.store_link is not None:
            await self.store_link.close()

    async def migration_stats(self) -> dict[str, dict[str, Any]]:
        """Per engine: requests migrated in and out, resumed from a checkpoint, and the measured times."""
        return {n: a.summary() for n, a in self.agents.items()}

    async def transfers(self) -> dict[str, dict[str, float]]:
        return {n: c.summary() for n, c in self.connectors.items()}

    def pid(self) -> int:
        return os.getpid()

    async def ping(self) -> bool:
        await asyncio.sleep(0)
        return True
