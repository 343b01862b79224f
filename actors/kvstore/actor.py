"""The Ray actor that hosts one region's KV store, and the handles engines use to reach it.

``KVStoreActor`` (wrapped by ``ray.remote`` in ``launch``) runs a ``StoreServer`` on the cluster's transport
backend (unshaped: the engines' ``StoreTier`` charges the store link's time on their own clocks) with a
``BlockStore`` of the spec's capacity (emulated GB x ``kv_payload_scale`` real bytes). Block traffic goes over
the transport only; Ray carries the control plane: start, the replica's address, the change log that keeps
the engines' views of the keys current (one call per engine every ``sync_interval_ms``), stats, stop.

``ActorIndex`` is the ``client.IndexSource`` over such an actor's handle; ``start_stores`` places a region's
store (and its replica) and wires the replication.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any, cast

from actors.clock import Clock
from actors.engine.kv_blocks import BlockHash
from actors.kv_connector import address_from_json, address_to_json
from actors.kvstore.server import Endpoint, StoreServer
from actors.kvstore.store import BlockStore, Changes
from config.cluster import ClusterSpec
from transport import Site, TransportOptions, backend_factory


class KVStoreActor:
    """One store of a region (see the module docstring)."""

    def __init__(self, spec_json: str, region: str, index: int = 0, host: str = "127.0.0.1") -> None:
        self.spec = ClusterSpec.model_validate_json(spec_json)
        if self.spec.kv_store is None:
            raise ValueError("the cluster spec has no kv_store section")
        self.region = region
        self.name = f"kvstore-{region}-{index}"
        self.host = host
        self.server: StoreServer | None = None

    async def start(self) -> dict[str, Any]:
        """Serve; returns the store's transport address (JSON form, as engines' addresses travel)."""
        cfg = self.spec.kv_store
        assert cfg is not None
        clock = Clock(self.spec.time_scale)
        endpoint = backend_factory(self.spec.transport.backend)(Site(self.name, self.region), clock,
                                                                TransportOptions(host=self.host))
        if not hasattr(endpoint, "offers"):
            raise TypeError(f"transport backend {self.spec.transport.backend!r} publishes no offers a store can serve")
        capacity = int(cfg.capacity_gb * 1e9 * self.spec.transport.kv_payload_scale)
        store = BlockStore(max(1, capacity), cfg.eviction, name=self.name)
        self.server = StoreServer(store, cast(Endpoint, endpoint), timeout_ms=cfg.timeout_ms)
        return address_to_json(await self.server.start())

    async def set_replica(self, address: dict[str, Any] | None) -> None:
        assert self.server is not None
        self.server.set_replica(address_from_json(address) if address is not None else None)

    async def changes_since(self, since: int) -> dict[str, Any]:
        assert self.server is not None
        ch = self.server.changes_since(since)
        return {"version": ch.version, "added": list(ch.added), "removed": list(ch.removed), "reset": ch.reset}

    async def stats(self) -> dict[str, Any]:
        assert self.server is not None
        s = self.server.store
        return {**asdict(self.server.stats), "blocks": len(s), "used_bytes": s.used_bytes,
                "capacity_bytes": s.capacity_bytes, "hits": s.hits, "misses": s.misses, "evictions": s.evictions,
                "corrupt": s.corrupt}

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None

    def pid(self) -> int:
        return os.getpid()


class ActorIndex:
    """A store actor's change log as a ``client.IndexSource`` (one Ray call per sync)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def changes_since(self, since: int) -> Changes:
        d = await self.handle.changes_since.remote(since)
        return Changes(int(d["version"]), tuple(BlockHash(h) for h in d["added"]),
                       tuple(BlockHash(h) for h in d["removed"]), bool(d["reset"]))


def start_stores(spec: ClusterSpec, host: str = "127.0.0.1", timeout_s: float = 60.0
                 ) -> dict[str, list[tuple[Any, dict[str, Any]]]]:
    """Place every region's store (and replica, when ``kv_store.replicate``): {region: [(handle, address)]}."""
    import ray

    if spec.kv_store is None:
        return {}
    cls = ray.remote(num_cpus=0, max_restarts=0)(KVStoreActor)
    spec_json = spec.model_dump_json()
    count = 2 if spec.kv_store.replicate else 1
    handles: dict[str, list[Any]] = {r.name: [cls.remote(spec_json, r.name, i, host) for i in range(count)]
                                     for r in spec.regions}
    out: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
    for region, hs in handles.items():
        addrs = ray.get([h.start.remote() for h in hs], timeout=timeout_s)
        out[region] = list(zip(hs, addrs, strict=True))
        if len(hs) > 1:
            ray.get(hs[0].set_replica.remote(addrs[1]), timeout=timeout_s)
    return out
