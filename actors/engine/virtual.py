"""Run the real engine and scheduler on virtual time: the clock jumps to each step's end.

The async step loop (``Engine._loop``) sleeps to every step's deadline on the emulated clock; that is
what the HTTP path needs, but it costs the step's emulated duration in wall time. For replaying
measured serving runs (``run_cluster.py validate``) only the emulated timeline matters, so
``VirtualDriver`` runs the same two halves of a step the loop runs (``Engine.plan_step`` then
``Engine.apply_step``), with a ``ManualTime`` behind the engine's ``Clock`` that is set to each step's
end instead of slept to. Scheduling, KV allocation, preemption and the cost model are the engine's own;
only waiting is skipped, so a run takes as long as its Python bookkeeping (no lag, by construction).

``ClosedLoop`` is a client population as benchmark tools run it (aiperf ``--concurrency``, vLLM's
``bench serve --max-concurrency``): ``concurrency`` clients each send a request, wait for its last
token, and send the next at once, until ``num_requests`` were sent. Prompts are distinct (their first
token is the prompt's index), so no prefix is shared by accident, unless the load draws them from a pool:
``prompt_pool`` distinct prompts, one drawn per request in send order with ``random.Random(pool_seed)
.choice``, as aiperf's dataset manager draws from its synthetic dataset (``--num-dataset-entries``, 100 by
default; ``--random-seed``), so a prompt drawn again hits the prefix cache if its blocks were not evicted.
``warmup_requests`` go first, through the same clients and the same draws; the measured requests start
only when every warm-up request has finished (aiperf runs its warm-up phase to completion first), all
``concurrency`` clients at once. Warm-up requests are not in the run's records.

Client turnaround (``turnaround_ms``): with async scheduling, vLLM's engine core plans step N+1 as soon as
step N is launched and step N+2 as soon as step N's outputs are processed (``step_with_batch_queue``, a
queue of two), so the client of a request whose last token came from step N is still receiving it when
N+2 is planned: its next request joins N+3 (N+2 without async scheduling). A turnaround of 0 would let it
join N+2, one step early.

Sending and arriving: a request is sent when a credit comes back (its client's previous request ended, or,
with ``ClosedLoop.client``, when the worker that held it finished its own work on it) and reaches the
engine when its client's worker has picked it up plus ``turnaround_ms``. Both are events on the driver's
timeline (``_returns``, ``_arrivals``), handed out once the run reaches them: requests enter the engine's
queue in arrival order, whatever order they were sent in (a busy worker sends late), as a server sees them.

Decode stretches (``VirtualDriver(fast_forward=True)``, the default): between two events (an arrival, a
prefill chunk, a finish, a preemption) a closed loop runs many steps that are pure decode of the same
sequences, each one token longer. The driver runs such a stretch of ``k`` steps at once: the cost model is
asked for each of the ``k`` steps (a decode step's shape is known in advance: the same sequences, every
context one longer), each sequence gets its ``k`` tokens, and the KV blocks are allocated and cached at
the steps where the step-by-step scheduler would (same order, same block ids). It applies only when the
step-by-step loop could do nothing else: nothing waiting, nothing left unfreed by async scheduling, no
held blocks, every running sequence decoding, none finishing within the stretch, enough free blocks for
all ``k`` steps (so no preemption), and no one but the driver listening to the engine; a stretch ends
with the step during which the next send or arrival falls due. The step that
finishes a sequence runs through ``plan_step``/``apply_step`` as any other. Exactness is under test: a
run gives the same records, steps and block pool with and without it.

Failure behaviour: a run whose waiting requests can never be scheduled (nothing running, nothing
arriving, the head still refused) raises ``VirtualRunStuck`` instead of spinning; a request the engine
refuses at submission raises the engine's ``EngineError``.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from actors.clock import Clock
from actors.cost_model import CostModel, StepShape, StepTime
from actors.engine.client_workers import ClientWorkers, WorkerPool
from actors.engine.engine import Engine, EngineConfig, RequestStream
from actors.engine.scheduler import ScheduledStep, TokenOutput
from actors.engine.sequence import RequestId, Sequence

MIN_STRETCH = 2
"""Decode stretches shorter than this run step by step (the checks cost about one step)."""


class VirtualRunStuck(RuntimeError):
    """The engine holds waiting requests it can never schedule (see the module docstring)."""


class ManualTime:
    """A monotonic time source (seconds) that moves only when told: the engine's ``Clock`` reads it.

    Kept in emulated ms (``ms``), as the driver compares it with step ends and arrivals: a ms -> s -> ms
    round trip can land a hair below the time it was set to, and an idle driver would wait for it forever.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self.ms = start_s * 1000.0

    @property
    def t(self) -> float:
        return self.ms / 1000.0

    def __call__(self) -> float:
        return self.ms / 1000.0

    def advance_to_ms(self, emulated_ms: float) -> None:
        """Jump to emulated ``emulated_ms`` (a clock at scale 1 with origin 0); never backwards."""
        self.ms = max(self.ms, emulated_ms)


def virtual_clock(time: ManualTime) -> Clock:
    """A clock at scale 1, origin 0, that reads ``time`` and never polls."""
    return Clock(1.0, spin_ms=0.0, monotonic=time, origin=0.0)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request as a benchmark client sees it (emulated ms)."""

    index: int
    arrival_ms: float
    first_scheduled_ms: float
    """Start of the first step that computed any of the request's prompt."""
    first_token_ms: float
    last_token_ms: float
    output_tokens: int
    preemptions: int

    @property
    def ttft_ms(self) -> float:
        return self.first_token_ms - self.arrival_ms

    @property
    def queue_ms(self) -> float:
        """TTFT's wait before the engine first scheduled the request (queue, and async scheduling's step)."""
        return self.first_scheduled_ms - self.arrival_ms

    @property
    def prefill_ms(self) -> float:
        """TTFT's rest: from the first scheduled step's start to the end of the step that emitted the token."""
        return self.first_token_ms - self.first_scheduled_ms

    @property
    def tpot_ms(self) -> float:
        """Mean time per output token after the first (0 for a one-token output), as aiperf and vLLM."""
        return (self.last_token_ms - self.first_token_ms) / max(1, self.output_tokens - 1)

    @property
    def e2e_ms(self) -> float:
        return self.last_token_ms - self.arrival_ms


@dataclass(frozen=True)
class ClosedLoop:
    """``concurrency`` clients, ``num_requests`` requests of exactly ``input_len`` -> ``output_len`` tokens."""

    concurrency: int
    num_requests: int
    input_len: int
    output_len: int
    burst_gap_ms: float = 0.0
    """The opening burst's client k arrives at ``k x burst_gap_ms`` (a server hands simultaneous requests
    to its engine one after another); later requests go out when their client's previous one ended."""
    turnaround_ms: float = 0.0
    """A client's next request reaches the engine this long after its previous request's last token (the
    token's way out to the client and the next request's way in). Any value above 0 moves the arrival past
    the planning of the step after the one that emitted the token (module docstring)."""
    warmup_requests: int = 0
    """Requests run before the measured ones, not recorded (module docstring)."""
    prompt_pool: int = 0
    """Distinct prompts the requests draw from (module docstring); 0: every request its own prompt."""
    pool_seed: int = 0
    """Seed of the draws from ``prompt_pool``."""
    client: ClientWorkers | None = None
    """The client's worker processes (``actors.engine.client_workers``): each finished request costs its
    worker ``post_ms`` before the credit is back, the next request goes out from the next worker in turn when
    that worker is free, and a chunk reaching a busy worker is timestamped when it is free. None: a client
    per slot, with no work of its own."""

    def __post_init__(self) -> None:
        if min(self.concurrency, self.num_requests, self.input_len, self.output_len) < 1:
            raise ValueError("concurrency, num_requests, input_len and output_len must be at least 1")
        if min(self.burst_gap_ms, self.turnaround_ms, self.warmup_requests, self.prompt_pool) < 0:
            raise ValueError("burst_gap_ms, turnaround_ms, warmup_requests and prompt_pool must not be negative")

    def prompt_indices(self) -> Callable[[], int]:
        """The prompt index of each request in send order (warm-up first): a fresh draw per call."""
        if self.prompt_pool == 0:
            counter = itertools.count()
            return lambda: next(counter)
        rng = random.Random(self.pool_seed)
        pool = range(self.prompt_pool)
        return lambda: rng.choice(pool)

    def prompt(self, index: int, vocab_size: int) -> list[int]:
        """The prompt of index ``index`` (one per request, or per pool entry): token ids from ``index``
        upwards, wrapped into the vocabulary, so two indices share no block."""
        span = max(2, vocab_size - 1)
        return [1 + (index + i) % span for i in range(self.input_len)]


@dataclass
class RunResult:
    records: list[RequestRecord]
    steps: int
    end_ms: float
    preemptions: int


class VirtualDriver:
    """Drives one ``Engine`` on virtual time with a ``ClosedLoop`` of clients (module docstring).

    Invariants: the clock never goes backwards; every step starts when the previous one ended or, after
    an idle stretch, when the earliest waiting request arrived (as the async loop); a request is in the
    engine's queue from its arrival on, never before, and requests enter it in arrival order.
    """

    def __init__(self, cfg: EngineConfig, cost: CostModel, *, fast_forward: bool = True) -> None:
        if cfg.tiers.enabled:
            raise ValueError(f"engine {cfg.name}: the virtual driver does not run KV tiers (their loads are "
                             "asynchronous I/O on the event loop); run the engine's own loop, or drop 'tiers'")
        self.fast_forward = fast_forward
        self.stretches = 0
        """Decode stretches run at once (module docstring), for tests and profiles."""
        self.time = ManualTime()
        self.engine = Engine(cfg, cost, virtual_clock(self.time), observers=[self])
        self._streams: dict[RequestId, RequestStream] = {}
        self._index: dict[RequestId, int] = {}
        self._records: list[RequestRecord] = []
        self._first_scheduled: dict[RequestId, float] = {}
        self._load: ClosedLoop | None = None
        self._sent = 0
        self._draw: Callable[[], int] | None = None
        self._enough: Callable[[list[RequestRecord]], bool] | None = None
        self._returns: list[float] = []
        """Heap of the times credits come back (a client free to send), handled once the run reaches them."""
        self._arrivals: list[tuple[float, int, list[int], int]] = []
        """Heap of requests sent but not yet at the engine: (arrival, send order, prompt, index). They are
        submitted once the run reaches their arrival, so the engine's queue is in arrival order whatever
        order they were sent in (a busy worker sends late)."""
        self._pool: WorkerPool | None = None
        self._worker: dict[RequestId, int] = {}
        self._seen_first: dict[RequestId, float] = {}

    # -- EngineObserver ----------------------------------------------------------------------------
    def on_step(self, engine: Engine, step: ScheduledStep, cost: StepTime, lag_wall_ms: float) -> None:
        for seq, _ in step.items:
            self._first_scheduled.setdefault(seq.request_id, step.start_ms)

    def on_tokens(self, engine: Engine, outputs: list[TokenOutput], end_ms: float) -> None:
        for out in outputs:  # nobody reads the streams: drain them so they hold no history
            stream = self._streams.get(out.seq.request_id)
            if stream is not None and not stream.queue.empty():
                stream.queue.get_nowait()
        pool = self._pool
        if pool is not None:
            for out in outputs:
                rid = out.seq.request_id
                if rid not in self._seen_first and rid in self._worker:
                    self._seen_first[rid] = pool.seen_ms(self._worker[rid], end_ms)

    def on_finish(self, engine: Engine, seq: Sequence) -> None:
        self._streams.pop(seq.request_id, None)
        index = self._index.pop(seq.request_id)
        first_scheduled = self._first_scheduled.pop(seq.request_id, seq.arrival_ms)
        if seq.first_token_ms is None or seq.last_token_ms is None:
            raise VirtualRunStuck(f"request {index} finished without a token ({seq.finish_reason})")
        first = self._seen_first.pop(seq.request_id, seq.first_token_ms)
        last = back = seq.last_token_ms
        worker = self._worker.pop(seq.request_id, None)
        if self._pool is not None and worker is not None:
            last = self._pool.seen_ms(worker, last)
            back = self._pool.post(worker, last, len(seq.output_ids))
        if index >= 0:
            self._records.append(RequestRecord(index, seq.arrival_ms, first_scheduled, first, last,
                                               len(seq.output_ids), seq.num_preemptions))
        heapq.heappush(self._returns, back)

    # -- running -----------------------------------------------------------------------------------
    def _next(self, at_ms: float, turnaround: bool = True) -> None:
        """A credit is back at ``at_ms``: send the next request of its phase, or open the measured phase
        once the warm-up's last credit is back (all clients at once)."""
        load = self._load
        if load is None:
            return
        if self._sent < load.warmup_requests:
            self._send(at_ms, turnaround)
        elif self._sent == load.warmup_requests:
            if not (self._streams or self._returns or self._arrivals):  # the warm-up phase is complete
                for k in range(min(load.concurrency, load.num_requests)):
                    self._send(at_ms + k * load.burst_gap_ms, turnaround)
        elif self._enough is None or not self._enough(self._records):
            self._send(at_ms, turnaround)

    def _drain(self, now_ms: float) -> None:
        """Hand out the credits that came back by ``now_ms`` (earliest first)."""
        while True:
            back = self._returns[0] if self._returns else math.inf
            arrive = self._arrivals[0][0] if self._arrivals else math.inf
            if min(back, arrive) > now_ms:
                return
            if arrive <= back:
                self._submit(*heapq.heappop(self._arrivals))
            else:
                self._next(heapq.heappop(self._returns))

    def _due(self) -> float:
        """The earliest credit back or arrival still to hand out (inf: none)."""
        return min(self._returns[0] if self._returns else math.inf,
                   self._arrivals[0][0] if self._arrivals else math.inf)

    def _idle_until(self, at_ms: float) -> None:
        """Nothing runs: jump to ``at_ms`` (an arrival or a credit back) and hand out the credits due."""
        self.time.advance_to_ms(at_ms)
        self._drain(at_ms)

    def _send(self, at_ms: float, turnaround: bool = True) -> None:
        """Send the next request: its credit's worker picks it up at ``at_ms`` or when free, and it reaches
        the engine ``turnaround_ms`` later (the very first sends of a run: at ``at_ms``)."""
        load = self._load
        assert load is not None and self._draw is not None
        if self._sent >= load.warmup_requests + load.num_requests:
            return
        worker = None
        if self._pool is not None:
            worker = self._pool.worker_of(self._sent)
            at_ms = self._pool.pickup_ms(worker, at_ms)
        if turnaround:
            at_ms += load.turnaround_ms
        i = self._sent - load.warmup_requests  # negative: a warm-up request
        self._sent += 1
        if worker is not None:
            self._worker[RequestId(f"r{i}")] = worker
        heapq.heappush(self._arrivals, (at_ms, self._sent, load.prompt(self._draw(), self.engine.cfg.vocab_size), i))

    def _submit(self, at_ms: float, _order: int, prompt: list[int], i: int) -> None:
        load = self._load
        assert load is not None
        stream = self.engine.submit(prompt, load.output_len, ignore_eos=True, request_id=f"r{i}", arrival_ms=at_ms)
        self._streams[stream.request_id] = stream
        self._index[stream.request_id] = i

    def run(self, load: ClosedLoop, enough: Callable[[list[RequestRecord]], bool] | None = None) -> RunResult:
        """Run ``load`` to completion; records sorted by request index.

        ``enough``: asked with the records finished so far (in finish order) before each further request
        is sent; once it says True, no more are sent and the run ends when those in flight finished.
        """
        self._load = load
        self._enough = enough
        self._records = []
        self._sent = 0
        self._draw = load.prompt_indices()
        self._returns = []
        self._arrivals = []
        self._pool = load.client.pool(load.concurrency) if load.client is not None else None
        if load.warmup_requests:
            for k in range(min(load.concurrency, load.warmup_requests)):
                self._send(k * load.burst_gap_ms, turnaround=False)
        else:
            self._next(0.0, turnaround=False)
        eng = self.engine
        sched = eng.scheduler
        prev_end: float | None = None
        while sched.has_work() or self._returns or self._arrivals:
            now = self.time.ms
            self._drain(now)
            if not sched.has_work():
                if self._due() == math.inf:
                    break
                self._idle_until(self._due())  # until the next credit back or arrival
                prev_end = None
                continue
            if self.fast_forward and prev_end is not None:
                end_k = self._decode_stretch(prev_end)
                if end_k is not None:
                    prev_end = end_k
                    continue
            if not sched.running:
                early = sched.earliest_waiting_arrival()
                if early is None or early > now:  # idle until the next arrival or credit back
                    nxt = min(early if early is not None else math.inf, self._due())
                    if nxt < math.inf:
                        self._idle_until(nxt)
                        prev_end = None
                        continue
            step = eng.plan_step(prev_end, now)
            if step is None:
                continue
            if step.empty:
                raise VirtualRunStuck(f"{len(sched.waiting)} waiting request(s) can never be scheduled "
                                      f"({eng.kv.pool.num_free} of {eng.cfg.num_blocks} KV blocks free)")
            cost = eng.cost.step(step.shape())
            end = step.start_ms + cost.total_ms
            self.time.advance_to_ms(end)
            prev_end = end
            eng.apply_step(step, cost, end, 0.0)
        self._records.sort(key=lambda r: r.index)
        return RunResult(self._records, eng.steps, self.time.ms, sched.stats.preemptions)

    # -- decode stretches --------------------------------------------------------------------------
    def _stretch_length(self) -> int:
        """Steps the running sequences can decode before anything else could happen (0: not a stretch).

        Bounded by the first finish (that step runs step by step) and by the free KV blocks (no step of
        the stretch may need a preemption). A waiting request is allowed only when the head of the queue
        has arrived and cannot be admitted even at the stretch's first step: free blocks only shrink during
        a stretch, so it cannot be admitted later in it either.
        """
        eng = self.engine
        sched = eng.scheduler
        limits = sched.limits
        if (sched.unfreed or sched.held or eng.kv_subscribers or eng.chunk_listeners
                or eng.change_listeners or eng.observers != [self] or eng.slowdown != 1.0):
            return 0
        running = sched.running
        if not running or len(running) > limits.max_num_batched_tokens:
            return 0
        k = 1 << 62
        for seq in running:
            if seq.hold_blocks or not seq.is_decoding:
                return 0
            out = len(seq.output_ids)
            first = min(seq.max_tokens - out, limits.max_context - seq.num_tokens)
            if seq.stop_after is not None:
                first = min(first, seq.stop_after - out)
            k = min(k, first - 1)  # the step emitting a sequence's last token runs step by step
        if k < MIN_STRETCH:
            return 0
        kv = eng.kv
        free = kv.pool.num_free
        if sched.waiting and not self._head_blocked(free - sum(kv.blocks_needed(seq, 1) for seq in running)):
            return 0
        if sum(kv.blocks_needed(seq, k) for seq in running) <= free:
            return k
        lo, hi = 0, k  # the longest stretch whose blocks fit: needs grow with k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sum(kv.blocks_needed(seq, mid) for seq in running) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo if lo >= MIN_STRETCH else 0

    def _head_blocked(self, free_at_admission: int) -> bool:
        """The waiting queue's head cannot be admitted at the stretch's first step (``Scheduler.schedule``'s
        admission rules), with ``free_at_admission`` blocks left after the running sequences' allocations.
        With prefix caching a hit's revived blocks make the count uncertain: not claimed then."""
        eng = self.engine
        sched = eng.scheduler
        limits = sched.limits
        if len(sched.running) >= limits.max_num_seqs:
            return True
        head = sched.waiting[0]
        if eng.kv.enable_caching or head.preloaded or not self._head_arrived():
            return False
        budget = limits.max_num_batched_tokens - len(sched.running)
        if budget <= 0:
            return True
        n = head.num_tokens - head.num_computed_tokens
        if 0 < limits.long_prefill_token_threshold < n:
            n = limits.long_prefill_token_threshold
        if n > budget:
            if not limits.enable_chunked_prefill:
                return True
            n = budget
        return eng.kv.blocks_needed(head, n) > free_at_admission

    def _head_arrived(self) -> bool:
        sched = self.engine.scheduler
        return bool(sched.waiting) and sched.waiting[0].arrival_ms <= (self.engine._last_start or 0.0)

    def _decode_stretch(self, start_ms: float) -> float | None:
        """Run a decode stretch starting at ``start_ms`` (module docstring); its end, or None if none."""
        k = self._stretch_length()
        if k == 0:
            return None
        eng = self.engine
        sched = eng.scheduler
        kv = eng.kv
        bs = kv.block_size
        running = list(sched.running)
        n = len(running)
        computed0 = [seq.num_computed_tokens for seq in running]
        # Time: the same steps, one at a time, each every context one token longer; the stretch ends with
        # the step during which the next credit comes back (the step-by-step loop hands it out after it).
        due = self._due()
        totals: list[float] = []
        context = sum(computed0)
        end = start_ms
        while len(totals) < k and end < due:
            context += n
            totals.append(eng.cost.step(StepShape(decode_seqs=n, decode_context=context,
                                                  kv_read_tokens=context)).total_ms)
            end += totals[-1]
        k = len(totals)
        if k < MIN_STRETCH:
            return None
        # Blocks: step j (1..k) allocates for a sequence whose token j starts a block (at planning, in
        # running order) and caches one whose computed tokens fill a block (at completion, in order).
        allocs: dict[int, list[int]] = defaultdict(list)
        fills: dict[int, list[int]] = defaultdict(list)
        for i, c in enumerate(computed0):
            for j in range(-(-c // bs) * bs - c + 1, k + 1, bs):  # c + j - 1 is a multiple of bs
                allocs[j].append(i)
            for j in range(bs - c % bs, k + 1, bs):  # c + j is a multiple of bs
                fills[j].append(i)
        outputs, bases = eng.outputs, eng._bases
        for seq in running:
            seq.output_ids.extend(outputs.tokens(bases[seq.request_id], len(seq.output_ids), k))
        for j in sorted(allocs.keys() | fills.keys()):
            for i in allocs.get(j, ()):
                seq = running[i]
                seq.num_computed_tokens = computed0[i] + j - 1
                if not kv.allocate(seq, 1):  # checked in _stretch_length: a bug if it happens
                    raise RuntimeError(f"decode stretch: no block for {seq.request_id} at step {j} of {k}")
            for i in fills.get(j, ()):
                seq = running[i]
                seq.num_computed_tokens = computed0[i] + j
                kv.cache_full_blocks(seq)
        for seq, c in zip(running, computed0, strict=True):
            seq.num_computed_tokens = c + k
        end = prev = start_ms
        for total in totals:
            eng._last_start = end
            eng.busy_ms += total
            eng.lag.add(0.0)
            prev, end = end, end + total
        eng.steps += k
        sched.stats.generation_tokens += n * k
        for seq in running:
            seq.prev_token_ms, seq.last_token_ms = prev, end
        eng._publish_kv_events()
        self.time.advance_to_ms(end)
        self.stretches += 1
        return end
