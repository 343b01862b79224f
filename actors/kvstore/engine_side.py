"""Wiring a worker's engines to their region's KV store: the store at the bottom of each engine's tier chain,
written through after prefill, read back on a prefix miss.

``StoreLink`` is one worker process's link to the stores (one unshaped transport for all its engines: the
store link's time is charged by the chain on the engine's clock, not by a link model). ``attach`` gives an
engine a ``StoreTier``:

- as the last level of the engine's ``TierChain`` (``TierChain.append``), or, for an engine without CPU/disk
  tiers, as a chain of its own (``wire_tiers``): a prefix found only in the store is loaded back as any tier
  load is (the request waits while others step; a failed get means recompute, counted as a fallback);
- written through (LMCache's ``store`` after prefill): every full block the engine's GPU prefix cache stores
  (a ``BlockStored`` KV event with medium ``GPU``) is put to the store in the background, unless the store
  already holds it, with the block's deterministic payload (``tiers.payload``), so any engine of the region
  can load it and check it byte-exact;
- announced: blocks this engine put are published as KV events with medium ``STORE`` (and removed when the
  store evicts them or goes away), so the router's prefix index knows the region's store holds them.

Failure behaviour: a put that fails or is dropped (too many in flight) loses nothing but a future hit; a dead
store leaves the engines' views at the next sync, after which nothing is asked of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actors.engine.engine import Engine
from actors.engine.kv_blocks import BlockHash, BlockRemoved, BlockStored, KVEvent
from actors.engine.tiers.admission import wire_tiers
from actors.engine.tiers.base import MEDIUM_GPU, MEDIUM_STORE
from actors.engine.tiers.chain import TierChain
from actors.engine.tiers.overhead import STORE_LOOKUP_MS, LookupPrice, with_store_path
from actors.engine.tiers.payload import BlockPayloads
from actors.kv_connector import address_from_json
from actors.kvstore.actor import ActorIndex
from actors.kvstore.client import StoreTier
from config.catalog import default_catalog
from config.cluster import ClusterSpec
from config.tiers import tier_devices
from transport import KVTransport, Site, TransportOptions, backend_factory

DEFAULT_HOST_LINK = "pcie-gen5-x16"
"""The host link a store-only chain crosses (the CPU tier spec's default)."""

Stores = dict[str, list[tuple[Any, dict[str, Any]]]]
"""{region: [(store actor handle, its transport address as JSON)]}, as ``actor.start_stores`` returns."""


class WriteThrough:
    """Puts an engine's newly cached GPU blocks to its store and announces them (see the module docstring)."""

    def __init__(self, engine: Engine, tier: StoreTier, chain: TierChain) -> None:
        self.engine = engine
        self.tier = tier
        self.chain = chain
        self.announced: set[BlockHash] = set()
        tier.on_stored = self.stored
        tier.on_change = self.changed

    def __call__(self, seq: int, events: list[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored) and ev.medium == MEDIUM_GPU:
                fresh = [h for h in ev.block_hashes if not self.tier.lookup((h,))]
                if fresh:
                    self.tier.put_behind([(h, self.chain.payloads.payload(h)) for h in fresh])

    def stored(self, keys: Sequence[BlockHash]) -> None:
        new = tuple(k for k in keys if k not in self.announced)
        if new:
            self.announced.update(new)
            self.chain.events.append(BlockStored(new, None, self.engine.cfg.block_size, MEDIUM_STORE))
            if self.chain.on_events is not None:
                self.chain.on_events()

    def changed(self, added: Sequence[BlockHash], removed: Sequence[BlockHash]) -> None:
        gone = tuple(k for k in removed if k in self.announced)
        if gone:
            self.announced.difference_update(gone)
            self.chain.events.append(BlockRemoved(gone, MEDIUM_STORE))
            if self.chain.on_events is not None:
                self.chain.on_events()


def attach_store(engine: Engine, tier: StoreTier) -> WriteThrough:
    """Put ``tier`` at the bottom of ``engine``'s chain (a chain of its own when the engine has no tiers),
    write the engine's new GPU blocks through to it, and start its key sync (before ``engine.start()``)."""
    if engine.tiers is None:
        cfg = engine.cfg
        emu_block = cfg.block_size * engine.cost.kv_bytes_per_token
        chain = TierChain([tier], BlockPayloads(emu_block, cfg.kv_payload_scale),
                          tier_devices()[DEFAULT_HOST_LINK], engine.clock, block_size=cfg.block_size,
                          io_timeout_s=cfg.tiers.io_timeout_s)
        engine.tiers = wire_tiers(engine, chain)
    else:
        chain = engine.tiers.chain
        chain.append(tier)
    counters = engine.tiers.counters
    engine.cost = with_store_path(engine.cost, engine.cfg.tiers.connector_overhead, "kernel-sync", chain.host_link,
                                  LookupPrice(STORE_LOOKUP_MS, lambda: counters.lookups,
                                              overlapped=engine.cfg.limits.async_scheduling))
    writer = WriteThrough(engine, tier, chain)
    engine.kv_subscribers.append(writer)
    tier.start()
    return writer


class StoreLink:
    """One worker process's link to its regions' KV stores (see the module docstring)."""

    def __init__(self, spec: ClusterSpec, stores: Stores, node: str, host: str = "127.0.0.1") -> None:
        if spec.kv_store is None:
            raise ValueError("the cluster spec has no kv_store section")
        self.spec = spec
        self.cfg = spec.kv_store
        self.stores = stores
        self.node = node
        self.host = host
        self._transports: dict[str, KVTransport] = {}
        self.tiers: dict[str, StoreTier] = {}

    def _transport(self, region: str, clock: Any) -> KVTransport:
        t = self._transports.get(region)
        if t is None:
            t = backend_factory(self.spec.transport.backend)(Site(f"{self.node}-kvstore", region), clock,
                                                             TransportOptions(host=self.host))
            self._transports[region] = t
        return t

    def attach(self, name: str, engine: Engine, region: str) -> StoreTier | None:
        """Give ``engine`` its region's store as its lowest tier (before ``engine.start()``)."""
        entries = self.stores.get(region)
        if not entries:
            return None
        link = default_catalog().links.get(self.cfg.link or self.spec.transport.intra_region_link)
        tier = StoreTier(self._transport(region, engine.clock),
                         [(address_from_json(a), ActorIndex(h)) for h, a in entries], link,
                         payload_scale=self.spec.transport.kv_payload_scale, timeout_ms=self.cfg.timeout_ms,
                         sync_interval_ms=self.cfg.sync_interval_ms, max_put_inflight=self.cfg.max_put_inflight)
        attach_store(engine, tier)
        self.tiers[name] = tier
        return tier

    def stats(self) -> dict[str, dict[str, int]]:
        from dataclasses import asdict

        return {n: asdict(t.stats) for n, t in self.tiers.items()}

    async def close(self) -> None:
        for t in self.tiers.values():
            await t.close()
        for tr in self._transports.values():
            await tr.close()
        self._transports.clear()
