"""The tier chain of one engine: GPU -> tiers[0] -> tiers[1] ... (CPU DRAM, disk, then part B's store).

Writes (write-back, as SGLang HiCache's ``write_back`` and LMCache's CPU -> disk spill): a block the GPU
cache evicts (``BlockPool.on_evict``), or a swapped-out sequence's block, is *staged* at once (its payload
held in memory, visible to ``lookup``) and queued for the writer task, which puts it into ``tiers[0]``; what
that tier evicts to make room is written to the next one down, and so on; the last tier's evictions are
dropped. A block already held by ``tiers[0]`` (or staged) is not written again.

Loads: ``start_load`` takes the keys of a prefix the GPU lacks, reads each from the highest level holding
it (staged payloads count as their target tier), checks every payload byte-exact against the block's
deterministic payload, and finishes at an *emulated* ready time. As in vLLM's offloading connector the
request waits (vLLM's WAITING_FOR_REMOTE_KVS) while other requests keep stepping, so the load overlaps
their compute; the engine resumes it at the first step starting after the ready time, once the real I/O
has also finished.

Modelled time: each level's ``transfer_s`` on the emulated bytes (not the payload-scaled ones), plus the
host link hop (GPU <-> DRAM) for every level that is not DRAM itself (a disk or store block crosses the host
link too: read into DRAM, then copied to the GPU, serially). Loads share one host-to-device lane and queue
on it (``_read_busy_ms``); writes queue per level on their own lane (``_write_busy_ms``), so a burst of
evictions delays later writes, not loads. A load of a block whose write has not landed waits for it.

Failure behaviour: every ``TierError`` from a get, a payload mismatch, or a read exceeding ``io_timeout_s``
wall seconds fails the load (the scheduler recomputes instead; ``fallbacks`` counts it by medium and
reason). A failing put drops those blocks (``store_failures``, ``store_errors``), never the request.
Nothing here raises into the engine.

Events: blocks landing in a level emit ``BlockStored`` with its medium, blocks it evicts ``BlockRemoved``;
swap keys (private to one request, not prefix hashes) are never announced.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from actors.engine.kv_blocks import BlockHash, BlockRemoved, BlockStored, KVEvent, blake2b_64
from actors.engine.tiers.base import MEDIUM_CPU, KVTier, TierError, TierIntegrity, TierMiss, TierTimeout
from actors.engine.tiers.cpu import CPUTier
from actors.engine.tiers.disk import DiskTier
from actors.engine.tiers.payload import BlockPayloads
from actors.engine.tiers.policies import make_policy
from config.tiers import TierDevice, TiersSpec, tier_devices

MAX_RELOCATIONS = 4
"""A load locates a block again at most this many times after a level said it had moved on."""


class ChainClock(Protocol):
    def now_ms(self) -> float: ...


@runtime_checkable
class TierObserver(Protocol):
    """What the chain reports (the engine's metrics implement it). Times are emulated seconds, bytes
    emulated bytes."""

    def on_tier_lookup(self, medium: str, queried_blocks: int, hit_blocks: int) -> None: ...

    def on_tier_load(self, medium: str, blocks: int, nbytes: float, seconds: float) -> None: ...

    def on_tier_store(self, medium: str, blocks: int, nbytes: float, seconds: float) -> None: ...

    def on_tier_evict(self, medium: str, blocks: int) -> None: ...

    def on_tier_fallback(self, medium: str, reason: str) -> None: ...


@dataclass
class MediumStats:
    queried_blocks: int = 0
    hit_blocks: int = 0
    load_blocks: int = 0
    load_bytes: float = 0.0
    load_s: float = 0.0
    store_blocks: int = 0
    store_bytes: float = 0.0
    store_s: float = 0.0
    store_failures: int = 0
    evictions: int = 0
    fallbacks: int = 0


@dataclass(eq=False)
class LoadTicket:
    """One load in flight: ``keys`` into the blocks a sequence holds; ``tokens`` computed once it lands."""

    keys: tuple[BlockHash, ...]
    tokens: int
    start_ms: float
    ready_ms: float
    segments: tuple[tuple[str, int, float], ...]
    """(medium, blocks, modelled seconds) per level read from."""
    task: asyncio.Task[None] | None = None
    error: str | None = None
    medium_failed: str | None = None

    @property
    def done(self) -> bool:
        return self.task is None or self.task.done()


@dataclass
class _Staged:
    payload: bytes
    level: int
    ready_ms: float


@dataclass
class _Write:
    level: int
    blocks: list[tuple[BlockHash, bytes]]
    seconds: float
    done_ms: float


class TierChain:
    """The levels below one engine's GPU cache (see the module docstring)."""

    def __init__(self, tiers: Sequence[KVTier], payloads: BlockPayloads, host_link: TierDevice,
                 clock: ChainClock, *, block_size: int, io_timeout_s: float = 2.0) -> None:
        if not tiers:
            raise ValueError("a tier chain needs at least one tier")
        self.tiers = list(tiers)
        self.payloads = payloads
        self.host_link = host_link
        self.clock = clock
        self.block_size = block_size
        self.io_timeout_s = io_timeout_s
        self.emu_block_bytes = payloads.emulated_block_bytes
        self.staged: dict[BlockHash, _Staged] = {}
        self.private: set[BlockHash] = set()
        self.events: list[KVEvent] = []
        self.stats: dict[str, MediumStats] = {t.medium: MediumStats() for t in self.tiers}
        self.fallback_reasons: Counter[tuple[str, str]] = Counter()
        """Loads that fell back to recompute, by (medium, error type)."""
        self.store_errors: Counter[tuple[str, str]] = Counter()
        self.observers: list[TierObserver] = []
        self.on_events: Callable[[], None] | None = None
        self.on_ready: Callable[[], None] | None = None
        """Told when a load's real I/O finished (the engine wakes its step loop)."""
        self.real_io_late = 0
        """Loads whose real I/O finished after their emulated ready time (the host was the bottleneck)."""
        self._queue: asyncio.Queue[_Write] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._loads: set[asyncio.Task[None]] = set()
        self._read_busy_ms = 0.0
        self._write_busy_ms = [0.0] * len(self.tiers)
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_loop(), name="kv-tier-writer")

    async def flush(self) -> None:
        """Wait until every queued write has landed (tests, benchmarks)."""
        while self._queue.qsize() or self.staged:
            await asyncio.sleep(0)
            if self._writer is None or self._writer.done():
                return

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in (self._writer, *self._loads) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._writer = None
        self._loads.clear()
        self.staged.clear()
        for tier in self.tiers:
            await tier.close()

    def append(self, tier: KVTier) -> None:
        """Add a level at the bottom: the region's shared KV store (``actors.kvstore``), known only once the
        engine's process has reached it, after the chain was built from the engine's config."""
        self.tiers.append(tier)
        self.stats.setdefault(tier.medium, MediumStats())
        self._write_busy_ms.append(0.0)

    # -- queries -----------------------------------------------------------------------------------
    def level_of(self, key: BlockHash) -> int | None:
        """The highest level holding ``key`` (a staged block counts as its target level)."""
        st = self.staged.get(key)
        if st is not None:
            return st.level
        for i, tier in enumerate(self.tiers):
            if tier.lookup((key,)):
                return i
        return None

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        """How many leading ``keys`` some level holds. No I/O."""
        n = 0
        for k in keys:
            if self.level_of(k) is None:
                break
            n += 1
        return n

    def note_lookup(self, queried_blocks: int, levels: Sequence[int] = ()) -> None:
        """Record a prefix lookup of ``queried_blocks`` blocks past the GPU's hit, ``levels`` the level each
        hit came from: a level is queried for what the levels above it did not have."""
        if queried_blocks <= 0:
            return
        hits = Counter(levels)
        remaining = queried_blocks
        for i, tier in enumerate(self.tiers):
            st = self.stats[tier.medium]
            st.queried_blocks += remaining
            st.hit_blocks += hits[i]
            for o in self.observers:
                o.on_tier_lookup(tier.medium, remaining, hits[i])
            remaining -= hits[i]

    # -- writes ------------------------------------------------------------------------------------
    def write_down(self, keys: Sequence[BlockHash], *, private: bool = False) -> None:
        """Stage blocks leaving the GPU and queue their write to the first level. ``private``: swap keys,
        never announced in KV events."""
        now = self.clock.now_ms()
        first = self.tiers[0]
        new = [k for k in dict.fromkeys(keys) if k not in self.staged and not first.lookup((k,))]
        if private:
            self.private.update(keys)
        if new and not self._closed:
            self._stage(0, [(k, self.payloads.payload(k)) for k in new], now)

    def _stage(self, level: int, blocks: list[tuple[BlockHash, bytes]], now: float) -> float:
        tier = self.tiers[level]
        nbytes = len(blocks) * self.emu_block_bytes
        seconds = tier.transfer_s(math.ceil(nbytes), True)
        if level == 0 and tier.medium != MEDIUM_CPU:
            seconds += self.host_link.transfer_s(nbytes, True)
        done = max(now, self._write_busy_ms[level]) + seconds * 1000.0
        self._write_busy_ms[level] = done
        for k, p in blocks:
            self.staged[k] = _Staged(p, level, done)
        self._queue.put_nowait(_Write(level, blocks, seconds, done))
        return done

    async def _write_loop(self) -> None:
        while True:
            w = await self._queue.get()
            tier = self.tiers[w.level]
            st = self.stats[tier.medium]
            try:
                res = await asyncio.wait_for(tier.put(w.blocks), self.io_timeout_s)
            except (TierError, TimeoutError) as e:
                st.store_failures += len(w.blocks)  # the blocks are lost: a later lookup misses them
                self.store_errors[(tier.medium, type(e).__name__)] += 1
                self._unstage(w.blocks)
                continue
            self._unstage(w.blocks)
            st.store_blocks += len(res.stored)
            nbytes = len(res.stored) * self.emu_block_bytes
            st.store_bytes += nbytes
            st.store_s += w.seconds
            for o in self.observers:
                o.on_tier_store(tier.medium, len(res.stored), nbytes, w.seconds)
            if res.evicted:
                st.evictions += len(res.evicted)
                for o in self.observers:
                    o.on_tier_evict(tier.medium, len(res.evicted))
            self._announce(BlockStored, res.stored, tier.medium)
            self._announce(BlockRemoved, res.evicted, tier.medium)
            if res.spill and w.level + 1 < len(self.tiers):
                self._stage(w.level + 1, list(res.spill), self.clock.now_ms())
            elif res.evicted and w.level + 1 == len(self.tiers):
                self.private.difference_update(res.evicted)

    def _unstage(self, blocks: list[tuple[BlockHash, bytes]]) -> None:
        for k, p in blocks:
            st = self.staged.get(k)
            if st is not None and st.payload is p:
                del self.staged[k]

    def _announce(self, kind: type[BlockStored] | type[BlockRemoved], keys: Sequence[BlockHash],
                  medium: str) -> None:
        public = tuple(k for k in keys if k not in self.private)
        if not public:
            return
        if kind is BlockStored:
            self.events.append(BlockStored(public, None, self.block_size, medium))
        else:
            self.events.append(BlockRemoved(public, medium))
        if self.on_events is not None:
            self.on_events()

    def take_events(self) -> list[KVEvent]:
        ev, self.events = self.events, []
        return ev

    # -- loads -------------------------------------------------------------------------------------
    def start_load(self, keys: Sequence[BlockHash], tokens: int) -> LoadTicket:
        """Begin loading ``keys`` (every one held by some level: call ``lookup`` first)."""
        now = self.clock.now_ms()
        levels: list[int] = []
        wait_ms = now
        for k in keys:
            lvl = self.level_of(k)
            if lvl is None:
                raise ValueError(f"block {k:#x} is in no tier: lookup before loading")
            levels.append(lvl)
            st = self.staged.get(k)
            if st is not None:
                wait_ms = max(wait_ms, st.ready_ms)
        segments: list[tuple[str, int, float]] = []
        total_s = 0.0
        for lvl, n in sorted(Counter(levels).items()):
            tier = self.tiers[lvl]
            nbytes = n * self.emu_block_bytes
            s = tier.transfer_s(math.ceil(nbytes), False)
            if tier.medium != MEDIUM_CPU:
                s += self.host_link.transfer_s(nbytes, False)
            segments.append((tier.medium, n, s))
            total_s += s
        start = max(wait_ms, self._read_busy_ms)
        ready = start + total_s * 1000.0
        self._read_busy_ms = ready
        ticket = LoadTicket(tuple(keys), tokens, now, ready, tuple(segments))
        task = asyncio.get_running_loop().create_task(self._load(ticket, levels), name="kv-tier-load")
        ticket.task = task
        self._loads.add(task)
        task.add_done_callback(self._load_done)
        return ticket

    def _load_done(self, task: asyncio.Task[None]) -> None:
        self._loads.discard(task)
        if self.on_ready is not None and not self._closed:
            self.on_ready()

    async def _load(self, ticket: LoadTicket, levels: list[int]) -> None:
        """Read every key, each from where it lives *now*: between ``start_load`` and the read a write may
        have landed or a level may have evicted a block to the next one down (the load's own GPU allocation
        writes blocks down), so levels are looked up again before each read, highest level first."""
        medium = self.tiers[levels[0]].medium if levels else ""
        got: dict[BlockHash, bytes] = {}
        pending = list(ticket.keys)
        moved = 0
        try:
            while pending:
                by_level: dict[int, list[BlockHash]] = {}
                for k in pending:
                    st = self.staged.get(k)
                    if st is not None:
                        got[k] = st.payload
                        continue
                    lvl = next((i for i, t in enumerate(self.tiers) if t.lookup((k,))), None)
                    if lvl is None:
                        raise TierMiss(medium, f"block {k:#x} left every tier before it was read")
                    by_level.setdefault(lvl, []).append(k)
                if not by_level:
                    break
                lvl, keys = min(by_level.items())
                tier = self.tiers[lvl]
                medium = tier.medium
                try:
                    data = await asyncio.wait_for(tier.get(keys), self.io_timeout_s)
                except TimeoutError:
                    raise TierTimeout(tier.name, f"no answer in {self.io_timeout_s:g} s") from None
                except TierMiss:
                    # Evicted (moved down) after it was located (the writer ran before the read began):
                    # locate again, a bounded number of times.
                    moved += 1
                    if moved > MAX_RELOCATIONS:
                        raise
                    continue
                if len(data) != len(keys):
                    raise TierIntegrity(tier.name, f"{len(data)} blocks for {len(keys)} asked")
                for k, d in zip(keys, data, strict=True):
                    if not self.payloads.matches(k, d):
                        raise TierIntegrity(tier.name, f"block {k:#x} came back with other bytes")
                    got[k] = d
                pending = [k for k in pending if k not in got]
        except TierError as e:
            ticket.error = f"{type(e).__name__}: {e}"
            ticket.medium_failed = medium
        if self.clock.now_ms() > ticket.ready_ms:
            self.real_io_late += 1

    def finish_load(self, ticket: LoadTicket) -> bool:
        """Account a load that is done (its ready time passed, its I/O finished): True if it succeeded."""
        if ticket.error is not None:
            self._fallback(ticket.medium_failed or "", ticket.error.split(":", 1)[0])
            return False
        for medium, n, s in ticket.segments:
            st = self.stats[medium]
            st.load_blocks += n
            st.load_bytes += n * self.emu_block_bytes
            st.load_s += s
            for o in self.observers:
                o.on_tier_load(medium, n, n * self.emu_block_bytes, s)
        return True

    def cancel_load(self, ticket: LoadTicket) -> None:
        if ticket.task is not None:
            ticket.task.cancel()

    def _fallback(self, medium: str, reason: str) -> None:
        st = self.stats.get(medium)
        if st is not None:
            st.fallbacks += 1
        self.fallback_reasons[(medium, reason)] += 1
        for o in self.observers:
            o.on_tier_fallback(medium, reason)

    # -- reporting ---------------------------------------------------------------------------------
    def held(self) -> dict[str, list[int]]:
        """The public keys each in-process level holds, by medium (the feed's snapshot; a shared store
        reports its own contents)."""
        out: dict[str, list[int]] = {}
        for tier in self.tiers:
            keys = tier.blocks if isinstance(tier, CPUTier) else tier.index if isinstance(tier, DiskTier) else None
            if keys is not None:
                out[tier.medium] = [int(k) for k in keys if k not in self.private]
        return out

    def summary(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for tier in self.tiers:
            st = self.stats[tier.medium]
            u = tier.usage()
            out[tier.name] = {**{k: float(v) for k, v in vars(st).items()}, "blocks": u.blocks,
                              "capacity_blocks": u.capacity_blocks, "real_bytes": u.real_bytes}
        return out


def swap_key(request_id: str, tokens: int) -> BlockHash:
    """The key of a swapped-out sequence's partial last block (not a prefix hash: private to the request)."""
    return BlockHash(blake2b_64(b"swap\0" + request_id.encode() + b"\0" + str(tokens).encode()) or 1)


def build_chain(spec: TiersSpec, *, block_size: int, kv_bytes_per_token: float, payload_scale: float,
                clock: ChainClock, label: str) -> TierChain | None:
    """The chain an engine's ``TiersSpec`` describes (None when no tier is configured)."""
    if not spec.enabled:
        return None
    devices = tier_devices()
    emu_block = block_size * kv_bytes_per_token
    tiers: list[KVTier] = []
    host = devices[spec.cpu.link] if spec.cpu is not None else devices["pcie-gen5-x16"]
    if spec.cpu is not None:
        tiers.append(CPUTier(max(1, int(spec.cpu.capacity_gb * 1e9 // emu_block)), host,
                             make_policy(spec.cpu.policy)))
    if spec.disk is not None:
        directory = Path(spec.disk.directory) if spec.disk.directory is not None else None
        tiers.append(DiskTier(max(1, int(spec.disk.capacity_gb * 1e9 // emu_block)), devices[spec.disk.device],
                              make_policy(spec.disk.policy), directory, label))
    return TierChain(tiers, BlockPayloads(emu_block, payload_scale), host, clock, block_size=block_size,
                     io_timeout_s=spec.io_timeout_s)


