"""Launching an emulated cluster on Ray: embedded local cluster or an attached one.

``launch(spec)`` starts (or attaches to) Ray, places the GPU worker actors (``num_cpus=0``; by default one
per emulated node, or ``gpus_per_actor`` GPUs to an actor), waits until every engine answers ``/health``, starts the
router actor, and returns a ``ClusterHandle``. Attached to a Ray cluster (``address``), kvmesh's packages go to
the workers by ``runtime_env``, and with ``placement.hosts`` each actor is pinned to its host's custom resource
after ``cluster.placement.plan_placement`` checked that the cluster has every host (nothing starts otherwise).
``handle.shutdown()`` stops exactly what it started: its actors by handle, and the Ray instance only when it
started it (never an attached cluster's nodes); nothing else on the host is touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from config.cluster import ClusterSpec, EngineInstance

ProgressFn = Callable[[str], None]
CODE_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_PACKAGES = ("actors", "cluster", "config", "transport")
"""What an attached cluster's workers import, sent by ``runtime_env`` (``py_modules``)."""


@dataclass
class ClusterHandle:
    spec: ClusterSpec
    engines: dict[str, dict[str, Any]]
    router_url: str
    workers: list[Any] = field(repr=False, default_factory=list)
    routers: dict[str, Any] = field(repr=False, default_factory=dict)
    kv_stores: dict[str, list[Any]] = field(repr=False, default_factory=dict)
    """Each region's KV store actors (the first serves, the second is its replica), when the spec has them."""
    router_urls: dict[str, str] = field(default_factory=dict)
    """Router URL by residency zone when the router is partitioned, else {"*": url}."""
    owns_ray: bool = False
    ray_tmp: str | None = None
    startup_s: float = 0.0
    refused: dict[str, str] = field(default_factory=dict)
    """Engines that did not start (the DR manifest's check), with the reason: the router never sees them."""
    worker_pids: list[int] = field(default_factory=list)
    engine_actor: dict[str, int] = field(default_factory=dict)
    """Index into ``workers`` of the actor hosting each engine."""

    def kill_engine_actor(self, engine: str) -> None:
        """Fault injection: kill the actor process hosting ``engine`` (and any engine sharing it)."""
        import ray

        ray.kill(self.workers[self.engine_actor[engine]], no_restart=True)

    def kill_engine(self, engine: str, dead: set[str] | None = None, timeout_s: float = 30.0) -> list[str]:
        """Fault injection: end ``engine`` alone, whatever the density; the engines that died (``[engine]``).

        When it is the last live engine of its actor the process is killed (``ray.kill``); otherwise the actor
        ends that engine inside (``GpuWorker.kill_engines``: its connections dropped, feed gone, KV transport
        closed) and its other engines go on. ``dead``: engines already killed (default: none).
        """
        import ray

        if engine not in self.engine_actor:
            raise KeyError(f"no engine {engine!r} in the cluster")
        gone = dead or set()
        index = self.engine_actor[engine]
        alive = [n for n, i in self.engine_actor.items() if i == index and n not in gone and n != engine]
        if not alive:
            ray.kill(self.workers[index], no_restart=True)
        else:
            ray.get(self.workers[index].kill_engines.remote([engine]), timeout=timeout_s)
        return [engine]

    @property
    def engine_urls(self) -> dict[str, str]:
        return {n: d["url"] for n, d in self.engines.items()}

    def load(self) -> dict[str, dict[str, Any]]:
        import ray

        out: dict[str, dict[str, Any]] = {}
        for part in ray.get([w.load.remote() for w in self.workers], timeout=30):
            out.update(part)
        return out

    def blocks_returned(self, timeout_s: float = 10.0) -> bool:
        """Wait until every engine is idle with all its KV blocks free (no leak); False if not by then."""
        deadline = time.monotonic() + timeout_s
        while True:
            if all(v["free_blocks"] == v["num_blocks"] and v["running"] == 0 for v in self.load().values()):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        actors = [*self.routers.values(), *self.workers, *(s for ss in self.kv_stores.values() for s in ss)]
        with contextlib.suppress(Exception):
            ray.get([a.stop.remote() for a in actors], timeout=20)
        for a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        self.workers, self.routers, self.kv_stores = [], {}, {}
        if self.owns_ray:
            ray.shutdown()
            if self.ray_tmp:
                shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def __enter__(self) -> ClusterHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def host_cores() -> int:
    """CPU cores this process may run on (its affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def pack_engines(engines: list[EngineInstance], gpus_per_actor: int | None,
                 cores: int | None = None) -> list[list[EngineInstance]]:
    """Group engines of one node into actors of at most ``gpus_per_actor`` GPUs (an engine is never split).

    None (the default density) picks it from the spec and the host: one actor per emulated node, split
    further while the host has more cores than actors (``cores``, default ``host_cores()``), so that the
    engines' event loops can use every core (one Python process runs on one core at a time: 4 GPUs in one
    process streamed 0.6x the tokens/s of 4 processes on 2 cores, ``bench/density.py``).
    """
    limit: dict[str, int] = {}
    if gpus_per_actor is None:
        node_gpus: dict[str, int] = {}
        for e in engines:
            node_gpus[e.node] = node_gpus.get(e.node, 0) + e.tp
        per_node = max(1, (cores or host_cores()) // max(1, len(node_gpus)))
        limit = {n: -(-g // per_node) for n, g in node_gpus.items()}
    groups: list[list[EngineInstance]] = []
    current: list[EngineInstance] = []
    used = 0
    for e in engines:
        full = used + e.tp > (gpus_per_actor if gpus_per_actor is not None else limit[e.node])
        if current and (current[0].node != e.node or full):
            groups.append(current)
            current, used = [], 0
        current.append(e)
        used += e.tp
    if current:
        groups.append(current)
    return groups


def start_local_ray(**kwargs: Any) -> str:
    """Start an embedded Ray instance with a temp dir of its own (never attaching to another one).

    Returns the temp dir (the caller removes it after ``ray.shutdown()``).
    """
    import ray

    tmp = tempfile.mkdtemp(prefix="kvmesh-ray-", dir="/tmp")
    # Ray starts its workers at niceness 15; emulated GPUs must not yield to every other process.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address="local", _temp_dir=tmp, include_dashboard=False, log_to_driver=False, **kwargs)
    return tmp


def _init_ray(address: str | None) -> tuple[bool, str | None]:
    import ray

    if ray.is_initialized():
        return False, None
    if address:
        # The cluster's nodes may not have this checkout: ship kvmesh's packages with the job.
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"py_modules": [str(CODE_ROOT / p) for p in SHIPPED_PACKAGES]})
        return True, None
    return True, start_local_ray()


def _wait_router_ready(url: str, timeout_s: float) -> None:
    """Until the router's view has every worker eligible (feeds connected)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/workers", timeout=5) as r:
                workers = json.loads(r.read())
                if workers and all(w["eligible"] for w in workers):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"router {url} did not see every worker healthy within {timeout_s:.0f} s")
        time.sleep(0.05)


def _wait_healthy(urls: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        url = pending[0]
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    pending.pop(0)
                    continue
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"engines not healthy after {timeout_s:.0f} s: {', '.join(pending)}")
        time.sleep(0.1)


def launch(spec: ClusterSpec, *, address: str | None = None, host: str | None = None,
           timeout_s: float = 300.0, progress: ProgressFn | None = None) -> ClusterHandle:
    """Start the cluster described by ``spec`` and return its handle (see the module docstring)."""
    import ray

    from actors.worker import GpuWorker
    from cluster.placement import ROUTER_SHARE, actor_resources, advertised, plan_placement, ray_nodes
    from cluster.router.actor import RouterActor
    from cluster.router.checks import check_router_spec

    check_router_spec(spec.router)  # a bad policy or parameter fails here, before anything starts
    if spec.transport.faults is not None:
        from transport.faulty import FaultPlan  # the transport owns the fault kinds

        FaultPlan.model_validate(spec.transport.faults)
    say = progress or (lambda msg: None)
    t0 = time.monotonic()
    owns, tmp = _init_ray(address)
    handle = ClusterHandle(spec, {}, "", owns_ray=owns, ray_tmp=tmp)
    try:
        # Hosts checked against the Ray cluster before any actor starts; bind addresses follow the hosts.
        placement = plan_placement(spec, ray_nodes())
        if placement.unchecked_regions:
            say(f"region not checked for host(s) {', '.join(placement.unchecked_regions)}: their Ray nodes carry no "
                f"region label (ray.io/availability-region or region)")
        node_host = {n.name: n.host for n in spec.nodes}
        groups = pack_engines(spec.engines(), spec.gpus_per_actor)
        say(f"placing {sum(len(g) for g in groups)} engines on {len(groups)} worker actors")
        worker_cls = ray.remote(num_cpus=0, max_restarts=0)(GpuWorker)
        spec_json = spec.model_dump_json()
        handle.workers = [
            worker_cls.options(name=None, **actor_resources(node_host[g[0].node], sum(e.tp for e in g)))
            .remote(spec_json, [e.name for e in g], host or placement.bind_for(node_host[g[0].node]))
            for g in groups]
        # The routers' processes start now, beside the workers'; they learn the engines' URLs in ``start``.
        router_cls = ray.remote(num_cpus=0, max_restarts=0)(RouterActor)
        zones: list[str | None] = ([r.name for r in spec.regions] if spec.router.partition_by_residency
                                   else [None])
        router_host = spec.placement.router_host
        router_json = spec_json if router_host is None and spec.placement.bind_host == "auto" else spec.model_copy(
            update={"router": spec.router.model_copy(update={"host": placement.bind_for(router_host)})}
        ).model_dump_json()
        for zone in zones:
            handle.routers[zone or "*"] = router_cls.options(**actor_resources(router_host, ROUTER_SHARE)).remote(
                None, router_json, zone)
        if spec.kv_store is not None:
            from actors.kvstore.actor import start_stores

            say(f"starting the KV store of {len(spec.regions)} region(s)")
            stores = start_stores(spec, host or "127.0.0.1", timeout_s)
            handle.kv_stores = {r: [h for h, _ in hs] for r, hs in stores.items()}
            ray.get([w.attach_kv_stores.remote(stores) for w in handle.workers], timeout=timeout_s)
        started = ray.get([w.start.remote() for w in handle.workers], timeout=timeout_s)
        for i, part in enumerate(started):
            handle.refused.update({n: d["refused"] for n, d in part.items() if "refused" in d})
            part = {n: d for n, d in part.items() if "refused" not in d}
            handle.engines.update({n: advertised({**d, "host": node_host[d["node"]]}, placement.bind_for(
                node_host[d["node"]]), placement.address_for(node_host[d["node"]])) for n, d in part.items()})
            handle.engine_actor.update(dict.fromkeys(part, i))
        handle.worker_pids = ray.get([w.pid.remote() for w in handle.workers], timeout=timeout_s)
        say("waiting for every engine to answer /health")
        _wait_healthy([d["url"] for d in handle.engines.values()], timeout_s)
        urls = ray.get([a.start.remote(handle.engines) for a in handle.routers.values()], timeout=timeout_s)
        urls = [advertised({"url": u}, placement.bind_for(router_host), placement.address_for(router_host))["url"]
                for u in urls]
        handle.router_urls = dict(zip(handle.routers, urls, strict=True))
        for url in urls:
            _wait_router_ready(url, timeout_s)
        home = spec.router.region if spec.router.region in handle.router_urls else next(iter(handle.router_urls))
        handle.router_url = handle.router_urls[home]
        handle.startup_s = time.monotonic() - t0
        say(f"cluster up in {handle.startup_s:.1f} s, router at {handle.router_url}")
        return handle
    except BaseException:
        handle.shutdown()
        raise
