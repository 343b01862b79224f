"""The shared KV store as Ray actors over real TCP: a client round-trips blocks byte-exact, reads from the
replica once the store is killed, and degrades to misses (recompute) once both are gone."""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

import pytest

from actors.clock import Clock
from actors.engine.kv_blocks import BlockHash
from actors.engine.tiers.base import TierError, TierMiss
from actors.kv_connector import address_from_json
from actors.kvstore.actor import ActorIndex, start_stores
from actors.kvstore.client import StoreTier
from config import ClusterSpec, default_catalog
from transport import Site, TransportOptions, backend_factory

pytestmark = pytest.mark.integration

SPEC = {
    "name": "it-kvstore",
    "nodes": [{"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1,
               "engines": [{"name": "e", "model": "llama-3.1-8b"}]}],
    "transport": {"backend": "tcp", "kv_payload_scale": 0.01},
    "kv_store": {"capacity_gb": 10.0, "replicate": True, "timeout_ms": 2000.0},
}


async def synced(tier: StoreTier, hashes: list[BlockHash], want: int) -> None:
    for _ in range(100):
        await tier.sync()
        if tier.lookup(hashes) == want and all(len(s.keys) >= want for s in tier.stores if s.up):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"store view never reached {want} blocks: {[len(s.keys) for s in tier.stores]}")


def kill(handle: Any) -> None:
    """Kill a store actor and wait until its process is gone (Ray marks the actor dead before the process
    ends, and a process still serving its socket would answer the next get)."""
    import ray

    pid = ray.get(handle.pid.remote(), timeout=30)
    ray.kill(handle, no_restart=True)
    for _ in range(400):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the store actor's process {pid} outlived ray.kill")


async def test_store_actors_round_trip_fail_over_and_degrade(ray_cluster: object) -> None:
    import ray

    spec = ClusterSpec.model_validate(SPEC)
    stores = start_stores(spec)["local"]
    assert len(stores) == 2
    clock = Clock(1.0)
    transport = backend_factory("tcp")(Site("driver", "local"), clock, TransportOptions())
    tier = StoreTier(transport, [(address_from_json(a), ActorIndex(h)) for h, a in stores],
                     default_catalog().links.get("rdma-ib-ndr400"), timeout_ms=2000.0)
    try:
        rng = random.Random(7)
        blocks = [(BlockHash(rng.getrandbits(63) + 1), rng.randbytes(52_429)) for _ in range(32)]
        hashes = [h for h, _ in blocks]
        await tier.put(blocks)
        await synced(tier, hashes, 32)
        assert await tier.get(hashes) == [p for _, p in blocks]
        stats = ray.get([h.stats.remote() for h, _ in stores])
        assert stats[0]["blocks"] == 32 and stats[1]["blocks"] == 32 and stats[0]["replication_failures"] == 0

        kill(stores[0][0])  # the store dies mid-run: the replica serves the same bytes
        assert await tier.get(hashes[:8]) == [p for _, p in blocks[:8]]
        kill(stores[1][0])
        with pytest.raises(TierError):
            await tier.get(hashes)
        await tier.sync()  # both out of the view: lookups say miss, the engine recomputes
        assert tier.lookup(hashes) == 0
        with pytest.raises(TierMiss):
            await tier.get(hashes)
        assert tier.stats.sync_failures >= 2
    finally:
        await tier.close()
        await transport.close()
        for h, _ in stores:
            ray.kill(h, no_restart=True)


CLUSTER = {
    "name": "it-kvstore-cluster",
    "nodes": [{"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": 2,
               "engines": [{"name": "e", "model": "llama-3.1-8b", "replicas": 2,
                            "scheduler": {"num_gpu_blocks": 512}}]}],
    "transport": {"backend": "tcp", "kv_payload_scale": 0.001},
    "kv_store": {"capacity_gb": 20.0, "sync_interval_ms": 50.0},
    "router": {"policy": "round_robin"},
}


def test_a_store_killed_mid_run_leaves_every_request_served(ray_cluster: object) -> None:
    import aiohttp
    import ray

    from cluster.launch import launch

    h = launch(ClusterSpec.model_validate(CLUSTER))
    try:
        rng = random.Random(3)
        prefixes = [[rng.randrange(16, 100_000) for _ in range(1024)] for _ in range(4)]

        async def one(s: aiohttp.ClientSession, k: int) -> tuple[int, int]:
            body = {"model": "llama-3.1-8b", "prompt": [*prefixes[k % 4], k], "max_tokens": 8, "ignore_eos": True}
            async with s.post(h.router_url + "/v1/completions", json=body) as r:
                data = await r.json()
                return r.status, data.get("usage", {}).get("completion_tokens", 0)

        async def wave(start: int, n: int) -> list[tuple[int, int]]:
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(*(one(s, start + k) for k in range(n)))

        first = asyncio.run(wave(0, 8))  # round robin: each prefix prefilled on one engine, loaded by the other
        time.sleep(0.3)
        stats = ray.get(h.kv_stores["local"][0].stats.remote())
        assert stats["blocks"] >= 64  # written through after prefill (puts may be dropped under a burst)
        kill(h.kv_stores["local"][0])  # the store dies mid-run
        second = asyncio.run(wave(8, 16))
        assert all(r == (200, 8) for r in first + second), first + second
        assert h.blocks_returned()
    finally:
        h.shutdown()
