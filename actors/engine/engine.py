"""The engine: one emulated GPU (or TP group) running vLLM's step loop against the cost model.

Each step: plan (``Scheduler.schedule``), ask the cost model how long that batch takes, sleep to the
step's absolute deadline on the emulated clock, then apply the step (tokens out, blocks cached or freed,
KV events published) and record how late the wake-up really was (the step lag).

Time: a step starts when the previous one ended (``prev_end``) if the engine stayed busy, or, after an
idle wait, when the earliest waiting request arrived (its ``arrival_ms``, stamped by the API server as the
request came in). Only requests that arrived by a step's start join it. Because
every deadline is absolute, a late wake-up shortens the next sleep instead of shifting the timeline; a
host too slow to keep up shows as growing lag, which is measured and reported, never hidden.

Failure behaviour: a request that can never run (prompt beyond the context, more KV blocks than the
engine has) is refused at submission with ``EngineError``; aborting a request (client gone) frees its
blocks at once; ``stop()`` aborts everything still queued or running.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable

from actors.clock import LagRecorder
from actors.cost_model import CostModel, StepTime
from actors.engine.api import (
    EngineClock,
    EngineConfig,
    EngineError,
    EngineObserver,
    RequestStream,
    Reservation,
    StreamEvent,
)
from actors.engine.kv_blocks import BlockHash, KVEvent
from actors.engine.kv_manager import KVCacheManager
from actors.engine.scheduler import ScheduledStep, Scheduler, TokenOutput
from actors.engine.sequence import FinishReason, RequestId, SeqStatus, Sequence
from actors.engine.tiers.admission import attach_tiers
from actors.engine.tokenizer import OutputModel

__all__ = ["Engine", "EngineClock", "EngineConfig", "EngineError", "EngineObserver", "RequestStream", "Reservation",
           "StreamEvent"]


class Engine:
    """One emulated GPU engine (see the module docstring)."""

    def __init__(self, cfg: EngineConfig, cost: CostModel, clock: EngineClock,
                 observers: list[EngineObserver] | None = None) -> None:
        self.cfg = cfg
        self.cost = cost
        self.clock = clock
        self.kv = KVCacheManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.outputs = OutputModel(cfg.vocab_size)
        self.scheduler = Scheduler(cfg.limits, self.kv, self._next_token)
        self.observers = list(observers or [])
        self.kv_subscribers: list[Callable[[int, list[KVEvent]], None]] = []
        self.chunk_listeners: list[Callable[[Sequence, bool], None]] = []
        """Told, after each step, of every ``hold_blocks`` sequence that computed tokens in it (and
        whether it finished): how the KV connector streams a prefill's blocks as chunks complete."""
        self.change_listeners: list[Callable[[], None]] = []
        """Told whenever the load report may have changed (a step, an arrival, an abort, a release): the
        feed sends load on change instead of polling every engine on a timer."""
        self.lag = LagRecorder()
        self.steps = 0
        self.busy_ms = 0.0
        self.kv_event_seq = 0
        self._streams: dict[RequestId, RequestStream] = {}
        self._bases: dict[RequestId, int] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._stopping = False
        self.reserved: dict[RequestId, tuple[Sequence, Reservation]] = {}
        self.paused: dict[RequestId, Sequence] = {}
        """Requests out of the step loop while their KV moves to another engine (``pause``)."""
        self.held_until: dict[RequestId, float] = {}
        """Emulated time at which a finished prefill's held blocks are freed if nobody released them."""
        self._hold_lease: dict[RequestId, float] = {}
        self.lease_expiries = 0
        self._reaper: asyncio.Task[None] | None = None
        self._reap_wake = asyncio.Event()
        self._last_start: float | None = None
        self.slowdown = 1.0
        """Fault injection (``slow_gpu``): every step takes ``slowdown`` times the cost model's time (a
        straggler or a throttled GPU); 1.0 = as modelled."""
        self.tiers = attach_tiers(self)
        """CPU/disk tiers under the GPU cache (``actors.engine.tiers``), None when the config has none."""

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._loop(), name=f"engine-{self.cfg.name}")
            self._reaper = loop.create_task(self._reap(), name=f"engine-reaper-{self.cfg.name}")
            if self.tiers is not None:
                self.tiers.chain.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        for task in (self._task, self._reaper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._reaper = None
        for rid in list(self._streams):
            self.abort(rid)
        for rid in list(self.reserved):
            self.cancel_reservation(rid)
        for rid in list(self.scheduler.held):
            self.release(rid)
        for rid in list(self.paused):
            self.unpause(rid)
            self.abort(rid)
        if self.tiers is not None:
            await self.tiers.chain.close()

    # -- requests ----------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], max_tokens: int | None, *, ignore_eos: bool = False, seed: int = 0,
               request_id: str | None = None, arrival_ms: float | None = None, hold_blocks_ms: float | None = None,
               priority: int = 0, block_hashes: list[BlockHash] | None = None) -> RequestStream:
        """Queue a request; raises EngineError (400) when it can never run here.

        ``block_hashes``: the chained hashes of the prompt's first full blocks, computed ahead (the server
        hashes a long prompt in slices between loop turns, ``actors.server.hash_prompt_in_slices``); the
        engine hashes whatever is missing itself, as it needs it.

        ``hold_blocks_ms``: keep the request's KV blocks after it finishes (a prefill whose KV a decode
        engine takes) until ``release`` or for that many emulated ms (the lease). ``priority`` orders it
        under the ``priority`` scheduling policy (lower first, as vLLM's).
        """
        max_tokens = self._check(prompt_ids, max_tokens)
        rid = self._new_id(request_id)
        base = self.outputs.seed_of(prompt_ids, seed)
        seq = Sequence(rid, list(prompt_ids), max_tokens,
                       arrival_ms=self.clock.now_ms() if arrival_ms is None else arrival_ms,
                       stop_after=None if ignore_eos else self.outputs.natural_length(base),
                       hold_blocks=hold_blocks_ms is not None, priority=priority)
        if block_hashes is not None:
            if len(block_hashes) > len(prompt_ids) // self.cfg.block_size:
                raise ValueError(f"{len(block_hashes)} block hashes for a prompt of {len(prompt_ids)} tokens")
            seq.block_hashes = block_hashes
        if hold_blocks_ms is not None:
            self._hold_lease[rid] = hold_blocks_ms
        stream = RequestStream(self, seq)
        self._streams[rid] = stream
        self._bases[rid] = base
        self.scheduler.add(seq)
        self._poke()
        return stream

    def _new_id(self, request_id: str | None) -> RequestId:
        rid = RequestId(request_id or f"{self.cfg.name}-{next(self._ids)}")
        if rid in self._streams or rid in self.reserved or rid in self.scheduler.held or rid in self.paused:
            raise EngineError(400, f"request id {rid!r} is already in flight", "request_id")
        return rid

    def _check(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """Validate a request against this engine; the effective max_tokens."""
        if self._stopping:
            raise EngineError(503, "engine is shutting down")
        n_prompt = len(prompt_ids)
        limit = self.cfg.limits.max_context
        if n_prompt == 0:
            raise EngineError(400, "the prompt is empty", "prompt")
        if max_tokens is None:
            max_tokens = limit - n_prompt
        if max_tokens < 1:
            raise EngineError(400, "max_tokens must be at least 1", "max_tokens")
        if n_prompt + max_tokens > limit:
            raise EngineError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                   f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the messages, "
                                   f"{max_tokens} in the completion). Please reduce the length of the "
                                   "messages or completion.", "max_tokens")
        need = -(-(n_prompt + 1) // self.cfg.block_size)
        if need > self.cfg.num_blocks:
            raise EngineError(400, f"the prompt needs {need} KV blocks but this engine has {self.cfg.num_blocks}",
                              "prompt")
        return max_tokens

    # -- disaggregation: holding a prefill's KV, reserving and admitting a decode's -----------------
    def release(self, rid: RequestId) -> bool:
        """Free the blocks a finished prefill kept for its transfer."""
        self.held_until.pop(rid, None)
        ok = self.scheduler.release(rid)
        if ok:
            self._publish_kv_events()
            self._poke()
        return ok

    def reserve(self, prompt_ids: list[int], max_tokens: int | None, *, request_id: str,
                lease_ms: float, output_ids: list[int] | None = None) -> Reservation:
        """Set aside the blocks of a prompt whose KV will arrive from a prefill engine (``output_ids``: and
        of the tokens a migrating request generated so far, whose KV arrives with it).

        Raises EngineError 409 when the blocks are not free now (the caller waits and retries: decode
        memory is never double-booked). The reservation lapses after ``lease_ms`` emulated ms unless
        ``admit_preloaded`` claims it.
        """
        max_tokens = self._check(prompt_ids, max_tokens)
        rid = self._new_id(request_id)
        seq = Sequence(rid, list(prompt_ids), max_tokens, arrival_ms=self.clock.now_ms(),
                       output_ids=list(output_ids or ()))
        prefix = self.kv.find_prefix(seq)
        if not self.kv.allocate(seq, seq.num_tokens - prefix.num_tokens(self.cfg.block_size), prefix):
            raise EngineError(409, f"no room for {len(prompt_ids)} tokens of KV now "
                                   f"({self.kv.pool.num_free} blocks free)")
        seq.num_cached_prompt_tokens = prefix.num_tokens(self.cfg.block_size)
        res = Reservation(rid, len(prompt_ids), len(prefix.blocks), len(self.kv.blocks_of(rid)),
                          tuple(int(h) for h in seq.update_block_hashes(self.cfg.block_size)),
                          self.clock.now_ms() + lease_ms)
        self.reserved[rid] = (seq, res)
        self._reap_wake.set()
        self._poke()
        return res

    def cancel_reservation(self, rid: RequestId) -> bool:
        entry = self.reserved.pop(rid, None)
        if entry is None:
            return False
        self.kv.free(entry[0])
        self._publish_kv_events()
        self._poke()
        return True

    def admit_preloaded(self, rid: RequestId, first_token: int, *, ignore_eos: bool = False, seed: int = 0,
                        ) -> RequestStream:
        """The prompt's KV has arrived into the reserved blocks: decode from the prefill's first token."""
        entry = self.reserved.pop(rid, None)
        if entry is None:
            raise EngineError(404, f"no reservation for request {rid!r} (expired or never made)")
        seq = entry[0]
        base = self.outputs.seed_of(seq.prompt_ids, seed)
        seq.output_ids = [first_token]
        return self._admit(seq, base, None if ignore_eos else self.outputs.natural_length(base),
                           seq.num_prompt_tokens)

    def admit_resumed(self, rid: RequestId, computed_tokens: int, base: int, stop_after: int | None,
                      ) -> RequestStream:
        """A migrated request's KV (its first ``computed_tokens`` tokens) is in the reserved blocks: go on
        with the sampling state it had (``base``, ``stop_after``); the tokens past ``computed_tokens`` are
        recomputed in its first step, and its next token is the one at position ``len(output_ids)``."""
        entry = self.reserved.pop(rid, None)
        if entry is None:
            raise EngineError(404, f"no reservation for request {rid!r} (expired or never made)")
        seq = entry[0]
        computed = max(computed_tokens, seq.num_cached_prompt_tokens)
        return self._admit(seq, base, stop_after, min(computed, seq.num_tokens - 1))

    def _admit(self, seq: Sequence, base: int, stop_after: int | None, computed: int) -> RequestStream:
        rid = seq.request_id
        seq.stop_after = stop_after
        seq.num_computed_tokens = computed
        seq.preloaded = True
        now = self.clock.now_ms()
        seq.arrival_ms = seq.first_scheduled_ms = now
        self.kv.cache_full_blocks(seq)
        stream = RequestStream(self, seq)
        self._streams[rid] = stream
        self._bases[rid] = base
        if self.scheduler._finish_reason(seq) is not None:  # the first token was also the last
            self.scheduler._finish(seq, seq.finish_reason or FinishReason.LENGTH)
            self._close(seq, now)
            return stream
        self.scheduler.waiting.appendleft(seq)
        self._publish_kv_events()
        self._poke()
        return stream

    # -- live migration: a running request leaves with its KV ---------------------------------------
    def pause(self, rid: RequestId) -> tuple[Sequence, int] | None:
        """Take a running or waiting request out of the step loop, keeping its blocks and its stream (a
        step in progress computes nothing for it); its sequence and sampling base, or None if not here."""
        sched = self.scheduler
        seq = next((s for s in sched.sequences() if s.request_id == rid), None)
        if seq is None or rid not in self._streams:
            return None
        if seq in sched.running:
            sched.running.remove(seq)
        else:
            sched.waiting.remove(seq)
        seq.status = SeqStatus.PAUSED
        self.paused[rid] = seq
        self._poke()
        return seq, self._bases[rid]

    def sampling_base(self, rid: RequestId) -> int:
        """The output model's base of a request in flight here (token i is a function of it and i)."""
        return self._bases[rid]

    def unpause(self, rid: RequestId) -> bool:
        """The move failed: the paused request runs here again, from the KV it holds."""
        seq = self.paused.pop(rid, None)
        if seq is None:
            return False
        seq.status = SeqStatus.WAITING
        seq.preloaded = bool(self.kv.blocks_of(rid))  # its blocks are still here: no prefix lookup
        self.scheduler.waiting.appendleft(seq)
        self._poke()
        return True

    def hand_off(self, rid: RequestId) -> bool:
        """The paused request goes on elsewhere: end its stream here (``MIGRATED``) and free its blocks."""
        seq = self.paused.pop(rid, None)
        if seq is None:
            return False
        seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.MIGRATED
        self.kv.free(seq)
        stream = self._streams.pop(rid, None)
        self._bases.pop(rid, None)
        if stream is not None:
            stream.queue.put_nowait(StreamEvent((), self.clock.now_ms(), FinishReason.MIGRATED))
        self._publish_kv_events()
        self._poke()
        return True

    def _poke(self) -> None:
        """Wake the step loop and tell the change listeners (the feed) that the load may have changed."""
        self._wake.set()
        for notify in self.change_listeners:
            notify()

    def _next_lease_ms(self) -> float | None:
        due = [res.expires_ms for _, res in self.reserved.values()]
        due.extend(self.held_until.values())
        return min(due) if due else None

    async def _reap(self) -> None:
        """Free lapsed reservations and held prefill blocks nobody came for (leases).

        Sleeps to the earliest lease's end, or on an event while there is none: an idle engine does no
        timer work. A new lease wakes it to recompute the deadline."""
        while True:
            self._reap_wake.clear()
            due = self._next_lease_ms()
            if due is None:
                await self._reap_wake.wait()
                continue
            if due > self.clock.now_ms():
                await self._sleep_or_wake(due)
                continue
            now = self.clock.now_ms()
            for rid, (_, res) in list(self.reserved.items()):
                if res.expires_ms <= now:
                    self.lease_expiries += 1
                    self.cancel_reservation(rid)
            for rid in [r for r, t in self.held_until.items() if t <= now]:
                self.lease_expiries += 1
                self.release(rid)

    async def _sleep_or_wake(self, due_ms: float) -> None:
        """Wait on the clock until emulated ``due_ms`` or until a new lease sets ``_reap_wake``."""
        sleep = asyncio.ensure_future(self.clock.sleep_until(due_ms))
        wake = asyncio.ensure_future(self._reap_wake.wait())
        try:
            await asyncio.wait((sleep, wake), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (sleep, wake):
                t.cancel()
            await asyncio.gather(sleep, wake, return_exceptions=True)

    def abort(self, rid: RequestId) -> None:
        self._hold_lease.pop(rid, None)
        self.held_until.pop(rid, None)
        seq = self.scheduler.abort(rid)
        stream = self._streams.pop(rid, None)
        self._bases.pop(rid, None)
        if stream is not None:
            stream.queue.put_nowait(StreamEvent((), self.clock.now_ms(), FinishReason.ABORT))
        if seq is not None:
            for o in self.observers:
                o.on_finish(self, seq)
            self._publish_kv_events()
            self._poke()

    def _next_token(self, seq: Sequence) -> int:
        return self.outputs.token(self._bases[seq.request_id], len(seq.output_ids))

    # -- state -------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_usage(self) -> float:
        return self.kv.usage()

    def prefill_backlog_tokens(self) -> int:
        """Tokens still to compute before every admitted request has its first token (queued prompts, the
        rest of running prefills, recomputes after preemption): the prefill work a new arrival waits behind."""
        sched = self.scheduler
        return sum(max(0, s.num_tokens - 1 - s.num_computed_tokens)
                   for s in itertools.chain(sched.waiting, sched.running))

    def load(self) -> dict[str, float]:
        lag = self.lag.summary()
        return {"running": self.num_running, "waiting": self.num_waiting, "kv_usage": self.kv_usage(),
                "prefill_backlog_tokens": self.prefill_backlog_tokens(),
                "free_blocks": self.kv.pool.num_free, "num_blocks": self.cfg.num_blocks,
                "lag_p50_ms": lag["p50"], "lag_p99_ms": lag["p99"], "lag_max_ms": lag["max"],
                "steps": self.steps}

    # -- the step loop -----------------------------------------------------------------------------
    async def _loop(self) -> None:
        prev_end: float | None = None
        sched = self.scheduler
        while not self._stopping:
            if not sched.has_work():
                self._wake.clear()
                await self._wake.wait()
                prev_end = None
                continue
            step = self.plan_step(prev_end, self.clock.now_ms())
            if step is None:
                continue  # an unrunnable request was dropped: plan again
            if step.empty and self.tiers is not None and self.tiers.loading:
                prev_end = await self.tiers.wait(self.clock, self._wake)  # only loads in flight
                continue
            if step.empty:
                # Nothing can run until something finishes, is aborted or arrives.
                self._wake.clear()
                await self._wake.wait()
                prev_end = None
                continue
            cost = self.cost.step(step.shape())
            end = step.start_ms + cost.total_ms * self.slowdown
            lag = await self.clock.sleep_until(end)
            prev_end = end
            self.apply_step(step, cost, end, lag)
            await asyncio.sleep(0)  # let handlers run between steps even when the host lags

    def plan_step(self, prev_end: float | None, now: float) -> ScheduledStep | None:
        """Plan the next step (shared by the async loop and ``actors.engine.virtual``'s driver).

        ``prev_end``: when the previous step ended if the engine stayed busy, else None (waking from
        idle: the emulated GPU starts when the first waiting request arrived, so the emulator's own
        bookkeeping never delays the emulated timeline). The step's ``start_ms`` is its start. Returns
        None when an unrunnable request was dropped instead (plan again), an empty step when nothing
        can run until something finishes, is aborted or arrives.
        """
        sched = self.scheduler
        if prev_end is None:
            early = sched.earliest_waiting_arrival()
            start = now if early is None else min(now, early)
        else:
            start = prev_end
        # Async scheduling: vLLM planned this step when the previous one started, so only requests that
        # had arrived by then join it; with nothing to run it plans again at once (the step is empty).
        admit_by = (self._last_start if self.cfg.limits.async_scheduling and prev_end is not None
                    else None)
        step = sched.schedule(start, admit_by)
        if step.empty and admit_by is not None:
            step = sched.schedule(start)
        if step.empty and sched.waiting:
            # The queue's head may have arrived after ``start`` even when another waiting request arrived
            # before it (arrival is stamped before the body is read, so a big body is queued late): start
            # when the head arrived, else an idle engine would wait on a head it never admits.
            head = sched.waiting[0].arrival_ms
            if start < head <= now:
                step = sched.schedule(head)
        if step.empty and not sched.running and self._drop_unrunnable(step.start_ms):
            return None
        return step

    def apply_step(self, step: ScheduledStep, cost: StepTime, end: float, lag: float) -> None:
        """Apply a step that ended at emulated ``end``: tokens out, listeners and observers told, KV events."""
        self.steps += 1
        self._last_start = step.start_ms
        self.busy_ms += cost.total_ms
        self.lag.add(lag)
        outputs = self.scheduler.complete(step, end)
        if self.chunk_listeners:
            for seq, _ in step.items:
                if seq.hold_blocks:
                    for listener in self.chunk_listeners:
                        listener(seq, seq.done)
        self._deliver(outputs, end)
        for o in self.observers:
            o.on_step(self, step, cost, lag)
            o.on_tokens(self, outputs, end)
        self._publish_kv_events()
        for notify in self.change_listeners:
            notify()

    def _drop_unrunnable(self, now_ms: float) -> bool:
        """The head of the queue needs more blocks than the engine holds in total: finish it (length)."""
        head = self.scheduler.waiting[0] if self.scheduler.waiting else None
        if head is None or head.arrival_ms > now_ms:
            return False
        if self.kv.blocks_needed(head, head.num_tokens) <= self.cfg.num_blocks:
            return False
        self.scheduler.waiting.popleft()
        head.finish_reason = FinishReason.LENGTH
        self._close(head, now_ms)
        return True

    def _deliver(self, outputs: list[TokenOutput], end_ms: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.seq.request_id)
            if stream is None:
                continue
            stream.queue.put_nowait(StreamEvent((out.token_id,), end_ms, out.finish_reason))
            if out.finish_reason is not None:
                lease = self._hold_lease.pop(out.seq.request_id, None)
                if lease is not None:
                    self.held_until[out.seq.request_id] = end_ms + lease
                    self._reap_wake.set()
                self._streams.pop(out.seq.request_id, None)
                self._bases.pop(out.seq.request_id, None)
                for o in self.observers:
                    o.on_finish(self, out.seq)

    def _close(self, seq: Sequence, now_ms: float) -> None:
        stream = self._streams.pop(seq.request_id, None)
        self._bases.pop(seq.request_id, None)
        if stream is not None:
            stream.queue.put_nowait(StreamEvent((), now_ms, seq.finish_reason or FinishReason.LENGTH))
        for o in self.observers:
            o.on_finish(self, seq)

    def _publish_kv_events(self) -> None:
        events = self.kv.pool.take_events()
        if self.tiers is not None:
            events += self.tiers.chain.take_events()
        if not events:
            return
        self.kv_event_seq += 1
        for sub in self.kv_subscribers:
            sub(self.kv_event_seq, events)
