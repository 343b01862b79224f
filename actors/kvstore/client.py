"""The engine's side of the shared KV store: a ``KVTier`` (``actors.engine.tiers.base``) over the transport.

``StoreTier`` is the bottom of an engine's chain GPU -> CPU -> disk -> store. It talks to the region's
store (and its replica, when there is one) with plain transport calls (``server``: push to put, pull to
get), so a store behind ``tcp`` or ``ucx`` is reached exactly as a peer engine is.

Algorithm:
- ``lookup`` answers from a local view of each store's keys (no I/O, as the protocol requires): the keys this
  client put, plus every store's change log pulled every ``sync_interval_ms`` through an ``IndexSource``
  (the store actor, over Ray: a batched control-plane call, never per block). A store whose sync fails is
  taken out of the view until a sync succeeds again (so the router and the engine stop counting on it);
- ``put`` pushes the blocks, checksummed, to the first store (which copies them to its replica);
- ``get`` pulls from each store that holds the whole prefix in the view, in order, until one answers:
  the transport's pull is all or nothing and checks every block's checksum end to end, so a get returns
  every block byte-exact or raises a ``TierError`` (``TierMiss`` for a block the store no longer has,
  ``TierIntegrity`` for a checksum failure, ``TierTimeout`` past ``timeout_ms``, ``TierIOError`` for an
  unreachable store). Never a partial list;
- ``transfer_s``: the store link's time for the emulated bytes (plus a one-way latency for the request
  leg of a get), which the engine's chain charges on its clock.

Failure behaviour: every transport error becomes a ``TierError`` (the engine recomputes); a killed store
costs one failed call per attempt until the next sync takes it out of the view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from actors.engine.kv_blocks import BlockHash
from actors.engine.tiers.base import (
    MEDIUM_STORE,
    PutResult,
    TierError,
    TierIntegrity,
    TierIOError,
    TierMiss,
    TierTimeout,
    TierUsage,
)
from actors.kvstore.server import KV, PUT
from actors.kvstore.store import Changes
from config.link import LinkProfile
from transport.base import (
    Address,
    Block,
    BlockId,
    BlockNotFound,
    IntegrityError,
    KVTransport,
    TransferTimeout,
    TransportError,
)

log = logging.getLogger(__name__)


class IndexSource(Protocol):
    """Where a client learns what a store holds (the store actor over Ray, or the server itself in tests)."""

    async def changes_since(self, since: int) -> Changes: ...


ChangeListener = Callable[[Sequence[BlockHash], Sequence[BlockHash]], None]
"""(keys now in the store, keys no longer in it), as the syncs and failures reveal them."""
PutListener = Callable[[Sequence[BlockHash]], None]
"""Keys this client's put committed in a store (the engine announces them as KV events, medium ``STORE``)."""


@dataclass
class StoreEndpoint:
    """One store as a client sees it: where to reach it, where to learn its keys, and the view of them."""

    address: Address
    index: IndexSource
    keys: set[BlockHash]
    version: int = 0
    up: bool = True


@dataclass
class ClientStats:
    put_blocks: int = 0
    put_failures: int = 0
    put_dropped: int = 0
    get_blocks: int = 0
    get_failures: int = 0
    sync_failures: int = 0


class StoreTier:
    """A shared KV store as a tier of one engine (see the module docstring)."""

    name = "store"
    medium = MEDIUM_STORE

    def __init__(self, transport: KVTransport, stores: Sequence[tuple[Address, IndexSource]], link: LinkProfile,
                 *, payload_scale: float = 1.0, timeout_ms: float = 2_000.0, sync_interval_ms: float = 100.0,
                 max_put_inflight: int = 8, on_change: ChangeListener | None = None,
                 on_stored: PutListener | None = None) -> None:
        if not stores:
            raise ValueError("a store tier needs at least one store")
        self.transport = transport
        self.stores = [StoreEndpoint(a, ix, set()) for a, ix in stores]
        self.link = link
        self.payload_scale = payload_scale
        self.timeout_ms = timeout_ms
        self.sync_interval_ms = sync_interval_ms
        self.max_put_inflight = max_put_inflight
        self.on_change = on_change
        self.on_stored = on_stored
        self.stats = ClientStats()
        self._puts: set[asyncio.Task[None]] = set()
        self._sync_task: asyncio.Task[None] | None = None
        self._closed = False

    # -- view ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Begin syncing the view of the stores' keys (call from the engine's event loop)."""
        if self._sync_task is None:
            self._sync_task = asyncio.create_task(self._sync_loop(), name="kvstore-sync")

    async def sync(self) -> None:
        """Pull every store's changes once (the loop calls this; tests call it directly)."""
        for s in self.stores:
            try:
                ch = await asyncio.wait_for(s.index.changes_since(s.version),
                                            self.transport.clock.to_wall_s(self.timeout_ms))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # any failure of the control plane means "store down"
                self.stats.sync_failures += 1
                if s.up:
                    log.warning("kv store %s unreachable (%s): out of the view", s.address, e)
                    self._mark_down(s)
                continue
            self._apply(s, ch)

    def _mark_down(self, s: StoreEndpoint) -> None:
        gone = list(s.keys)
        s.up, s.keys, s.version = False, set(), 0
        self._notify((), [h for h in gone if not self._held_elsewhere(h)])

    def _apply(self, s: StoreEndpoint, ch: Changes) -> None:
        before = set(s.keys) if ch.reset or not s.up else None
        if before is not None:
            s.keys = set(ch.added)
            added = [h for h in ch.added if h not in before]
            removed = [h for h in before if h not in s.keys]
        else:
            s.keys.update(ch.added)
            s.keys.difference_update(ch.removed)
            added, removed = list(ch.added), list(ch.removed)
        s.version, s.up = ch.version, True
        self._notify(added, [h for h in removed if not self._held_elsewhere(h)])

    def _held_elsewhere(self, h: BlockHash) -> bool:
        return any(h in s.keys for s in self.stores)

    def _notify(self, added: Sequence[BlockHash], removed: Sequence[BlockHash]) -> None:
        if self.on_change is not None and (added or removed):
            self.on_change(added, removed)

    async def _sync_loop(self) -> None:
        clock = self.transport.clock
        while True:
            await self.sync()
            await clock.sleep_until(clock.now_ms() + self.sync_interval_ms)

    # -- KVTier -------------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        best = 0
        for s in self.stores:
            if not s.up:
                continue
            n = 0
            for h in hashes:
                if h not in s.keys:
                    break
                n += 1
            best = max(best, n)
        return best

    async def put(self, blocks: Sequence[tuple[BlockHash, bytes]]) -> PutResult:
        """Push the blocks to the first live store; returns once they are committed there."""
        target = next((s for s in self.stores if s.up), self.stores[0])
        wire = [Block.of(h, p).with_checksum() for h, p in blocks]
        try:
            await self.transport.push(target.address, PUT, wire,
                                      deadline_ms=self.transport.clock.now_ms() + self.timeout_ms)
        except TransportError as e:
            self.stats.put_failures += 1
            raise self._tier_error(e, "put") from e
        self.stats.put_blocks += len(wire)
        stored = tuple(h for h, _ in blocks)
        target.keys.update(stored)
        if self.on_stored is not None:
            self.on_stored(stored)
        return PutResult(stored=stored)

    def put_behind(self, blocks: Sequence[tuple[BlockHash, bytes]]) -> bool:
        """Put in the background (after a prefill: the step never waits on the store). False when dropped
        because ``max_put_inflight`` puts are already in flight."""
        if self._closed or len(self._puts) >= self.max_put_inflight:
            self.stats.put_dropped += 1
            return False
        task = asyncio.create_task(self._put_quietly(list(blocks)), name="kvstore-put")
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)
        return True

    async def _put_quietly(self, blocks: list[tuple[BlockHash, bytes]]) -> None:
        with contextlib.suppress(TierError):
            await self.put(blocks)

    async def get(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        if not hashes:
            return []
        ids = [BlockId(h) for h in hashes]
        holders = [s for s in self.stores if s.up and all(h in s.keys for h in hashes)]
        if not holders:
            self.stats.get_failures += 1
            raise TierMiss(self.name, f"no live store holds all {len(hashes)} blocks")
        error: TierError | None = None
        for s in holders:
            try:
                with await self.transport.pull(s.address, KV, ids,
                                               deadline_ms=self.transport.clock.now_ms() + self.timeout_ms) as d:
                    if [b.block_id for b in d.blocks] != ids:
                        raise TierIntegrity(self.name, "store answered other blocks than asked")
                    out = [bytes(b.payload) for b in d.blocks]
                self.stats.get_blocks += len(out)
                return out
            except TransportError as e:
                error = self._tier_error(e, "get")
                if isinstance(e, BlockNotFound):
                    s.keys.difference_update(hashes)  # the next sync would say so too
            except TierError as e:
                error = e
        self.stats.get_failures += 1
        assert error is not None
        raise error

    def _tier_error(self, e: TransportError, op: str) -> TierError:
        msg = f"{op}: {e}"
        if isinstance(e, BlockNotFound):
            return TierMiss(self.name, msg)
        if isinstance(e, IntegrityError):
            return TierIntegrity(self.name, msg)
        if isinstance(e, TransferTimeout):
            return TierTimeout(self.name, msg)
        return TierIOError(self.name, msg)

    def transfer_s(self, nbytes: int, write: bool) -> float:
        ms = self.link.transfer_ms(nbytes) + (0.0 if write else self.link.latency_us / 1000.0)
        return ms / 1000.0

    def usage(self) -> TierUsage:
        held = max((len(s.keys) for s in self.stores if s.up), default=0)
        return TierUsage(blocks=held, capacity_blocks=0, real_bytes=0)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [*self._puts, *([self._sync_task] if self._sync_task is not None else [])]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._puts.clear()
        self._sync_task = None
