"""The scheduler's side of the KV tiers: admitting a request through a lower tier, and swap preemption.

Admission (``try_load``, called for the head of the waiting queue after its GPU prefix hit): the blocks
past the GPU hit that some tier holds are loaded back, as vLLM's offloading connector does
(``get_num_new_matched_tokens`` -> WAITING_FOR_REMOTE_KVS): GPU blocks are allocated for them at once
(all or nothing, like any admission), the load starts, and the request leaves the waiting queue for
``loading``. Other requests keep stepping meanwhile. At the first step starting after the load's emulated
ready time (and once its real I/O finished) ``collect`` records the loaded blocks in the GPU prefix cache
and returns the request to the head of the queue holding KV for those tokens (``preloaded``: it computes
only the rest). A load that failed frees its blocks and the request recomputes (``skip_tiers``); no request
is lost.

Swap preemption (``on_preempt`` with ``swap``): the victim's computed KV (its full blocks by prefix hash,
its partial last block under a private swap key) is written to the first tier before its GPU blocks are
freed; at re-admission the same path loads it all back, so the request resumes exactly where it stopped
(the tokens it then emits are those it would have emitted). If the tier lost any of it, the request falls
back to an ordinary prefix lookup (recompute what is missing). The copy-out is charged on the write lane
(``TierChain``), not on the step: vLLM overlaps offloading stores with compute.

Counters follow vLLM's: ``external_queries``/``external_hits`` in tokens (vLLM's external prefix cache),
counted once per admitted request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from actors.engine.kv_blocks import BlockHash
from actors.engine.kv_manager import KVCacheManager, PrefixHit
from actors.engine.sequence import RequestId, Sequence
from actors.engine.tiers.chain import LoadTicket, TierChain, TierObserver, build_chain, swap_key
from actors.engine.tiers.overhead import with_store_path

if TYPE_CHECKING:
    from actors.engine.engine import Engine


class Admit(Enum):
    NONE = "none"
    """No tier holds anything past the GPU hit: admit as usual."""
    STARTED = "started"
    """A load started: the request left the waiting queue."""
    BLOCKED = "blocked"
    """Not enough free GPU blocks for the load: admission stops (head-of-line, as any admission)."""


class WakeClock(Protocol):
    def now_ms(self) -> float: ...

    async def sleep_until(self, deadline_ms: float) -> float: ...


@dataclass
class TierCounters:
    loads: int = 0
    fallbacks: int = 0
    swaps_out: int = 0
    swaps_in: int = 0
    external_queries: int = 0
    external_hits: int = 0
    lookups: int = 0
    """Requests looked up in the tiers (once each, when first admitted)."""


@dataclass
class _Loading:
    seq: Sequence
    ticket: LoadTicket
    gpu_tokens: int
    swap: bool


class TieredKV:
    """See the module docstring. Invariant: a request is in at most one of waiting, running, ``loading``;
    a loading request holds GPU blocks for ``ticket.tokens`` tokens."""

    def __init__(self, chain: TierChain, kv: KVCacheManager, swap: bool) -> None:
        self.chain = chain
        self.kv = kv
        self.swap = swap
        self.loading: dict[RequestId, _Loading] = {}
        self.counters = TierCounters()
        self._probe: dict[RequestId, tuple[int, list[int]]] = {}

    # -- admission ---------------------------------------------------------------------------------
    def try_load(self, seq: Sequence, prefix: PrefixHit) -> Admit:
        if seq.skip_tiers:
            return Admit.NONE
        bs = self.kv.block_size
        hashes = seq.update_block_hashes(bs)
        g = len(prefix.blocks)
        plan = self._swap_plan(seq, hashes, g)
        swap = plan is not None
        if plan is None:
            cand = hashes[g:(seq.num_tokens - 1) // bs]
            n = self.chain.lookup(cand)
            plan = (cand[:n], (g + n) * bs)
            self._probe[seq.request_id] = (len(cand), [self.chain.level_of(k) or 0 for k in cand[:n]])
        keys, tokens = plan
        if not keys:
            return Admit.NONE
        if not self.kv.allocate(seq, tokens - g * bs, prefix):
            return Admit.BLOCKED
        ticket = self.chain.start_load(keys, tokens)
        self.loading[seq.request_id] = _Loading(seq, ticket, g * bs, swap)
        self.counters.loads += 1
        return Admit.STARTED

    def _swap_plan(self, seq: Sequence, hashes: list[BlockHash], g: int) -> tuple[list[BlockHash], int] | None:
        done = seq.swap_tokens
        bs = self.kv.block_size
        if done <= g * bs:
            seq.swap_tokens = 0
            return None
        keys = list(hashes[g:done // bs])
        if done % bs:
            keys.append(swap_key(seq.request_id, done))
        if self.chain.lookup(keys) < len(keys):
            seq.swap_tokens = 0  # the tier lost part of it: an ordinary lookup, recompute the rest
            return None
        return keys, done

    def collect(self, now_ms: float) -> list[Sequence]:
        """Requests whose load is over by ``now_ms`` (in ready order), set to resume or to recompute."""
        done = sorted((ld for ld in self.loading.values() if ld.ticket.ready_ms <= now_ms and ld.ticket.done),
                      key=lambda ld: ld.ticket.ready_ms)
        out: list[Sequence] = []
        for ld in done:
            seq = ld.seq
            del self.loading[seq.request_id]
            seq.swap_tokens = 0
            if self.chain.finish_load(ld.ticket):
                seq.num_computed_tokens = ld.ticket.tokens
                seq.tier_tokens += ld.ticket.tokens - ld.gpu_tokens
                self.kv.cache_full_blocks(seq)
                seq.preloaded = True
                self.counters.swaps_in += ld.swap
            else:
                self.kv.free(seq)
                seq.num_computed_tokens = 0
                seq.skip_tiers = True
                self.counters.fallbacks += 1
            out.append(seq)
        return out

    def admitted(self, seq: Sequence) -> None:
        """A request ran for the first time: count its lookup (vLLM's external prefix cache counters)."""
        queried, levels = self._probe.pop(seq.request_id, (0, []))
        self.chain.note_lookup(queried, levels)
        self.counters.external_queries += seq.num_prompt_tokens
        self.counters.external_hits += seq.tier_tokens
        self.counters.lookups += 1

    # -- preemption, abort -------------------------------------------------------------------------
    def on_preempt(self, seq: Sequence) -> None:
        """Called before a victim's blocks are freed: with ``swap``, write its computed KV down."""
        seq.skip_tiers = False
        done = seq.num_computed_tokens
        if not self.swap or done <= 0:
            return
        bs = self.kv.block_size
        self.chain.write_down(seq.update_block_hashes(bs)[:done // bs])
        if done % bs:
            self.chain.write_down([swap_key(seq.request_id, done)], private=True)
        seq.swap_tokens = done
        self.counters.swaps_out += 1

    def abort(self, rid: RequestId) -> Sequence | None:
        ld = self.loading.pop(rid, None)
        self._probe.pop(rid, None)
        if ld is None:
            return None
        self.chain.cancel_load(ld.ticket)
        self.kv.free(ld.seq)
        return ld.seq

    # -- the engine's idle wait --------------------------------------------------------------------
    async def wait(self, clock: WakeClock, wake: asyncio.Event) -> float | None:
        """Nothing can step but loads are in flight: sleep to the earliest ready time or until ``wake``.
        Returns the emulated time to start the next step at (the ready time), or None when something
        else (an arrival, an abort) woke the engine first."""
        wake.clear()  # before looking: a load finishing from now on sets it again
        due = min(ld.ticket.ready_ms for ld in self.loading.values())
        now = clock.now_ms()
        if due > now:
            sleep = asyncio.ensure_future(clock.sleep_until(due))
            woken = asyncio.ensure_future(wake.wait())
            try:
                await asyncio.wait((sleep, woken), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (sleep, woken):
                    t.cancel()
                await asyncio.gather(sleep, woken, return_exceptions=True)
            return due if clock.now_ms() >= due else None
        if not any(ld.ticket.done for ld in self.loading.values() if ld.ticket.ready_ms <= now):
            await wake.wait()  # due in emulated time, real I/O still running: its end sets ``wake``
        return due


def attach_tiers(engine: Engine) -> TieredKV | None:
    """Build the engine's tier chain from its config and wire it in: GPU evictions written down, loads and
    swap in the scheduler, tier events published with the GPU's, tier observers fed. None without tiers."""
    cfg = engine.cfg
    chain = build_chain(cfg.tiers, block_size=cfg.block_size, kv_bytes_per_token=engine.cost.kv_bytes_per_token,
                        payload_scale=cfg.kv_payload_scale, clock=engine.clock, label=cfg.name)
    if chain is None:
        return None
    engine.cost = with_store_path(engine.cost, cfg.tiers.connector_overhead, "dma-async", chain.host_link)
    return wire_tiers(engine, chain)


def wire_tiers(engine: Engine, chain: TierChain) -> TieredKV:
    """Wire ``chain`` into ``engine`` (before it starts): what ``attach_tiers`` does with the chain it built;
    also used for a chain of the shared store alone (``actors.kvstore.engine_side``)."""
    tiers = TieredKV(chain, engine.kv, engine.cfg.tiers.preemption == "swap")
    engine.kv.pool.on_evict = chain.write_down
    engine.scheduler.tiers = tiers
    chain.on_events = engine._publish_kv_events
    chain.on_ready = engine._wake.set
    chain.observers = [o for o in engine.observers if isinstance(o, TierObserver)]
    return tiers
