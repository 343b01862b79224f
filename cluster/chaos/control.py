"""The real ``ClusterControl``: fault injection over a launched cluster (``cluster.launch.ClusterHandle``).

Every method is a blocking Ray control call (about a millisecond each; the chaos runner calls them off its
event loop). It keeps the handle current as the cluster changes: killed engines are remembered in
``dead``; a replacement engine is a new worker actor appended to ``handle.workers`` (its index recorded in
``handle.engine_actor``, its launch facts in ``handle.engines``); a restarted router replaces the old actor
in ``handle.routers`` and listens on the same URL, so clients keep their address.

Failure behaviour: an engine name the cluster lacks raises ``KeyError``; a Ray call past ``timeout_s``
raises ``GetTimeoutError``; a replacement or a new router that does not become healthy within
``timeout_s`` raises ``TimeoutError`` (the runner logs each as that action's error).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from cluster.chaos.schedule import KvEvents


def _wait_url(url: str, ok: Any, timeout_s: float) -> None:
    """Poll ``url`` (GET, JSON or empty) until ``ok(answer)``; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                raw = r.read()
                if ok(json.loads(raw) if raw else None):
                    return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready within {timeout_s:.0f} s")
        time.sleep(0.05)


class RayClusterControl:
    """``ClusterControl`` over a launched cluster; remembers the dead (see the module docstring)."""

    def __init__(self, handle: Any, timeout_s: float = 60.0) -> None:
        self.handle = handle
        self.timeout_s = timeout_s
        self.dead: set[str] = set()
        self.replaced: list[str] = []
        self.dead_stores: list[str] = []
        self.kv_disturbed: dict[str, dict[str, int]] = {}
        """Per engine, the KV batches lost/duplicated/reordered (summed over its ``kv_events`` periods)."""

    # -- actors ------------------------------------------------------------------------------------
    def _actor(self, engine: str) -> Any:
        if engine not in self.handle.engine_actor:
            raise KeyError(f"no engine {engine!r} in the cluster")
        return self.handle.workers[self.handle.engine_actor[engine]]

    def _alive(self) -> list[str]:
        return sorted(n for n in self.handle.engines if n not in self.dead)

    def _by_actor(self, engines: Sequence[str]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for n in engines:
            if n not in self.dead:
                out.setdefault(self.handle.engine_actor[n], []).append(n)
        return out

    def _call_each(self, calls: list[Any]) -> list[Any]:
        import ray

        return list(ray.get(calls, timeout=self.timeout_s))

    # -- kinds -------------------------------------------------------------------------------------
    def kill_engine(self, engine: str) -> list[str]:
        """That engine alone, whatever the density (``ClusterHandle.kill_engine``: the process when it was
        the last live engine there, else the engine inside it)."""
        self._actor(engine)  # KeyError naming an unknown engine
        gone = self.handle.kill_engine(engine, self.dead, self.timeout_s)
        self.dead.update(gone)
        return gone

    def replace_engine(self, engine: str) -> None:
        """A fresh actor hosting one engine of that name (from the spec), added to every router."""
        import ray

        from actors.worker import GpuWorker

        if engine not in self.dead:
            raise ValueError(f"engine {engine!r} is alive: only a killed engine is replaced")
        host = urlsplit(self.handle.engines[engine]["url"]).hostname or "127.0.0.1"
        worker_cls = ray.remote(num_cpus=0, max_restarts=0)(GpuWorker)
        actor: Any = worker_cls.remote(self.handle.spec.model_dump_json(), [engine], host)
        started: dict[str, dict[str, Any]] = ray.get(actor.start.remote(), timeout=self.timeout_s)
        self.handle.workers.append(actor)
        self.handle.engine_actor[engine] = len(self.handle.workers) - 1
        self.handle.engines[engine] = started[engine]
        self.dead.discard(engine)
        self.replaced.append(engine)
        _wait_url(started[engine]["url"] + "/health", lambda _: True, self.timeout_s)
        body = json.dumps({"name": engine, **started[engine]}).encode()
        for url in self.handle.router_urls.values():
            req = urllib.request.Request(url + "/workers", body, {"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(req, timeout=self.timeout_s):
                pass

    def engines_on_node(self, node: str) -> list[str]:
        return sorted(n for n, d in self.handle.engines.items() if d.get("node") == node and n not in self.dead)

    def drain(self, engine: str) -> None:
        self._call_each([self._actor(engine).drain.remote([engine])])

    def set_slowdown(self, engine: str, factor: float) -> None:
        self._call_each([self._actor(engine).set_slowdown.remote([engine], factor)])

    def partition(self, engines: Sequence[str], between: str, on: bool) -> None:
        workers = self.handle.workers
        if between == "router":
            self._call_each([workers[i].partition_from_router.remote(names, on)
                             for i, names in self._by_actor(engines).items()])
            return
        locations = {n: self.handle.engines[n]["kv_address"]["location"]
                     for n in engines if "kv_address" in self.handle.engines[n]}
        if len(locations) < 2:
            raise ValueError(f"a partition between engines needs two with a KV transport, got {sorted(locations)}")
        self._call_each([workers[self.handle.engine_actor[n]].partition_from_peers.remote(
            [n], [loc for m, loc in locations.items() if m != n], on) for n in locations if n not in self.dead])

    def disturb_kv_events(self, event: KvEvents, on: bool) -> None:
        engines = list(event.engines) or self._alive()
        parts = self._call_each([self.handle.workers[i].disturb_kv_events.remote(
            names, event.loss, event.duplicate, event.reorder, event.seed, on)
            for i, names in self._by_actor(engines).items()])
        for part in parts:
            for name, counts in part.items():
                mine = self.kv_disturbed.setdefault(name, {})
                for k, v in counts.items():
                    mine[k] = mine.get(k, 0) + v

    def restart_router(self, down_s: float, graceful: bool = True) -> None:
        """Stop every router (``graceful``: each ends its open streams with an error event and stops listening;
        else a crash) and kill its actor; after ``down_s`` emulated s start new ones on the same ports."""
        import ray

        from cluster.router.actor import RouterActor

        h = self.handle
        if graceful:
            self._call_each([old.shutdown.remote() for old in h.routers.values()])
        for old in h.routers.values():
            ray.kill(old, no_restart=True)
        time.sleep(down_s * h.spec.time_scale)
        live = {n: d for n, d in h.engines.items() if n not in self.dead}
        router_cls = ray.remote(num_cpus=0, max_restarts=0)(RouterActor)
        for zone, url in h.router_urls.items():
            port = urlsplit(url).port
            spec = h.spec.model_copy(update={"router": h.spec.router.model_copy(update={"port": port})})
            actor: Any = router_cls.remote(live, spec.model_dump_json(), None if zone == "*" else zone)
            h.routers[zone] = actor
            new_url = ray.get(actor.start.remote(), timeout=self.timeout_s)
            if new_url != url:
                raise RuntimeError(f"the new router listens on {new_url}, not {url}")
            _wait_url(url + "/workers", lambda ws: bool(ws) and all(w["eligible"] for w in ws), self.timeout_s)

    def set_transfer_faults(self, plan: Mapping[str, Any] | None) -> None:
        alive = sorted({self.handle.engine_actor[n] for n in self._alive()})
        self._call_each([self.handle.workers[i].set_transfer_faults.remote(dict(plan) if plan else None)
                         for i in alive])

    def kill_store(self, region: str | None, replica: int | None) -> list[str]:
        """``ray.kill`` the region's store actors (or one replica); KeyError for a region or replica the
        cluster lacks (a spec without ``kv_store`` has none)."""
        import ray

        stores: dict[str, list[Any]] = getattr(self.handle, "kv_stores", {}) or {}
        regions = sorted(stores) if region is None else [region]
        if not regions or any(r not in stores for r in regions):
            raise KeyError(f"no KV store in region {region!r} (stores in: {', '.join(sorted(stores)) or 'none'})")
        gone: list[str] = []
        for r in regions:
            picks = range(len(stores[r])) if replica is None else [replica]
            for k in picks:
                if k >= len(stores[r]):
                    raise KeyError(f"region {r!r} has {len(stores[r])} store(s), no replica {k}")
                ray.kill(stores[r][k], no_restart=True)
                gone.append(f"store {r}/{k}")
        self.dead_stores.extend(gone)
        return gone

    # -- state after the run -----------------------------------------------------------------------
    def alive_loads(self) -> dict[str, dict[str, Any]]:
        """Each surviving engine's load (free/total blocks, running)."""
        alive = sorted({self.handle.engine_actor[n] for n in self._alive()})
        out: dict[str, dict[str, Any]] = {}
        for part in self._call_each([self.handle.workers[i].load.remote() for i in alive]):
            out.update({n: v for n, v in part.items() if n not in self.dead})
        return out

    def index_agreement(self) -> dict[str, dict[str, Any]]:
        """Per surviving engine: the blocks its cache holds, those the routers' prefix indexes hold for it,
        and whether every router's index equals the engine's state."""
        alive = sorted({self.handle.engine_actor[n] for n in self._alive()})
        truth: dict[str, list[int]] = {}
        for part in self._call_each([self.handle.workers[i].cached_hashes.remote() for i in alive]):
            truth.update({n: v for n, v in part.items() if n not in self.dead})
        views = self._call_each([r.indexed_hashes.remote() for r in self.handle.routers.values()])
        out: dict[str, dict[str, Any]] = {}
        for n, held in truth.items():
            mine = set(held)
            seen = [set(v.get(n, ())) for v in views]
            out[n] = {"engine_blocks": len(mine), "router_blocks": [len(s) for s in seen],
                      "missing": max((len(mine - s) for s in seen), default=0),
                      "extra": max((len(s - mine) for s in seen), default=0),
                      "equal": all(s == mine for s in seen)}
        return out
