"""The step scheduler: waiting queue, running set, token budget, chunked prefill, preemption.

It follows vLLM v1's ``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py``, 0.19) rule by rule;
the README's scheduler table lists what is emulated and what is not. One step:

1. Running sequences first, in running-list order: each gets the tokens it still lacks (1 for a decode,
   the rest of its prompt for a prefill), capped by ``long_prefill_token_threshold`` (when > 0), by what
   is left of the step's token budget. If its blocks cannot be allocated, a
   victim is preempted by recompute (blocks freed, progress reset, back to the head of the waiting
   queue) until the allocation fits or the sequence itself was the victim, which ends the running pass.
   The victim is the *last* running sequence (``fcfs``) or the running sequence of lowest priority,
   latest arrival first (``priority``); a victim already scheduled this step gives its tokens back.
2. Then, only if nothing was preempted this step, waiting sequences from the head of the queue (arrival
   order, or (priority, arrival) with ``priority``) while budget, ``max_num_seqs`` and KV blocks allow.
   Each starts after its longest cached prefix, which may be its own blocks freed by a preemption and
   not yet reused (the free queue evicts lazily), and is capped by the threshold and the budget; without
   chunked prefill a prompt that does not fit the budget waits. A sequence whose blocks cannot be
   allocated stops admission (head-of-line, as vLLM).
3. The step's shape (prefill chunks with their context, decodes with theirs) goes to the cost model.

After the step (``complete``), each sequence's computed count advances; one whose tokens are all
computed emits a token; a sequence that reaches ``max_tokens``, its natural end or the context limit
finishes and frees its blocks.

Async scheduling (``async_scheduling``, vLLM's ``--async-scheduling``, on by default in 0.19): vLLM
plans step N+1 while step N runs and learns step N's outputs only after that. So (a) a request that
arrived after step N started joins step N+2 at the earliest (the engine passes ``admit_by``); (b) the
blocks of a request that finished in step N are freed after step N+1 was planned; (c) a request that
stopped on its own (EOS) in step N is still computed in step N+1, its token discarded, whereas one that
reaches ``max_tokens`` is not (vLLM knows it in advance). Token times seen by clients do not change.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from actors.cost_model import StepShape
from actors.engine.kv_manager import KVCacheManager
from actors.engine.sequence import FinishReason, RequestId, SeqStatus, Sequence
from actors.engine.tiers.admission import Admit, TieredKV

Policy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_context: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    """A prefill chunk takes at most this many tokens of a step (0: no cap), as vLLM's setting."""
    policy: Policy = "fcfs"
    async_scheduling: bool = False


class WaitingQueue(Protocol):
    """The waiting queue's interface (deque-like, as the engine and the scheduler use it)."""

    def append(self, seq: Sequence) -> None: ...

    def appendleft(self, seq: Sequence) -> None: ...

    def popleft(self) -> Sequence: ...

    def remove(self, seq: Sequence) -> None: ...

    def __getitem__(self, i: int) -> Sequence: ...

    def __iter__(self) -> Iterator[Sequence]: ...

    def __len__(self) -> int: ...


class FCFSQueue(deque[Sequence]):
    """Arrival order; a preempted sequence goes back to the head (``appendleft``)."""


class PriorityQueue:
    """Lowest (priority, arrival, insertion) first, as vLLM's ``PriorityRequestQueue``: ``appendleft``
    is an ordinary insert (a preempted sequence keeps its rank, not the head). Only ``[0]`` indexes."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self._count = itertools.count()

    def append(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.priority, seq.arrival_ms, next(self._count), seq))

    appendleft = append

    def popleft(self) -> Sequence:
        return heapq.heappop(self._heap)[3]

    def remove(self, seq: Sequence) -> None:
        self._heap = [e for e in self._heap if e[3] is not seq]
        heapq.heapify(self._heap)

    def __getitem__(self, i: int) -> Sequence:
        if i != 0:
            raise IndexError("a priority queue only shows its head")
        return self._heap[0][3]

    def __iter__(self) -> Iterator[Sequence]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))

    def __len__(self) -> int:
        return len(self._heap)


_NOT_STEPPING = (SeqStatus.FINISHED, SeqStatus.ABORTED, SeqStatus.PAUSED)
"""A scheduled sequence in one of these states when its step completes gets nothing from it (a tuple: the
enum members compare by identity in C, a set would call ``Enum.__hash__`` in Python)."""

QUEUES: dict[str, Callable[[], WaitingQueue]] = {"fcfs": FCFSQueue, "priority": PriorityQueue}


def _victim_fcfs(running: list[Sequence]) -> Sequence:
    return running[-1]


def _victim_priority(running: list[Sequence]) -> Sequence:
    return max(running, key=lambda s: (s.priority, s.arrival_ms))


VICTIMS: dict[str, Callable[[list[Sequence]], Sequence]] = {"fcfs": _victim_fcfs, "priority": _victim_priority}


@dataclass
class ScheduledStep:
    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    start_ms: float = 0.0

    @property
    def empty(self) -> bool:
        return not self.items

    def shape(self) -> StepShape:
        prefills: list[tuple[int, int]] = []
        decodes: list[int] = []
        for seq, n in self.items:
            computed = seq.num_computed_tokens
            out = seq.output_ids
            if n == 1 and out and computed == len(seq.prompt_ids) + len(out) - 1:  # ``seq.is_decoding``, inlined
                decodes.append(computed + 1)
            else:
                prefills.append((n, computed))
        return StepShape.of(prefills, decodes)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


@dataclass(slots=True)
class TokenOutput:
    """One token a step emitted for ``seq``. Treated as immutable but not ``frozen``, as ``StreamEvent``: one is
    built per output token, and a frozen slotted dataclass takes three times as long to build."""

    seq: Sequence
    token_id: int
    finish_reason: FinishReason | None


@dataclass
class SchedulerStats:
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


class Scheduler:
    """One engine's scheduler (the module docstring states the rules, in vLLM's order).

    Invariants: a running sequence holds blocks for every computed token; a waiting sequence holds none
    (async scheduling's not-yet-freed finishers aside, which are neither running nor waiting); a step
    never exceeds ``max_num_batched_tokens`` nor runs more than ``max_num_seqs`` sequences.
    """

    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager,
                 next_token: Callable[[Sequence], int]) -> None:
        if limits.policy not in QUEUES:
            raise ValueError(f"unknown scheduling policy {limits.policy!r} (known: {', '.join(QUEUES)})")
        self.limits = limits
        self.kv = kv
        self.next_token = next_token
        self.waiting: WaitingQueue = QUEUES[limits.policy]()
        self._victim = VICTIMS[limits.policy]
        self.running: list[Sequence] = []
        self.held: dict[RequestId, Sequence] = {}
        """Finished sequences whose blocks are kept for a transfer (``hold_blocks``), until ``release``."""
        self.unfreed: list[Sequence] = []
        """Async scheduling: sequences finished in the last step, freed once the next step is planned."""
        self.stats = SchedulerStats()
        self.tiers: TieredKV | None = None
        """KV tiers below the GPU (``actors.engine.tiers.admission``): loads at admission, swap preemption."""

    # -- queue -------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def release(self, rid: RequestId) -> bool:
        """Free the blocks a finished ``hold_blocks`` sequence kept; False when there is none."""
        seq = self.held.pop(rid, None)
        if seq is None:
            return False
        self.kv.free(seq)
        return True

    def abort(self, rid: RequestId) -> Sequence | None:
        self.release(rid)
        loading = self.tiers.abort(rid) if self.tiers is not None else None
        if loading is not None:
            return self._finish(loading, FinishReason.ABORT)
        for seq in self.running:
            if seq.request_id == rid:
                self.running.remove(seq)
                return self._finish(seq, FinishReason.ABORT)
        for seq in self.waiting:
            if seq.request_id == rid:
                self.waiting.remove(seq)
                return self._finish(seq, FinishReason.ABORT)
        return None

    def sequences_with_blocks(self) -> int:
        return len(self.running) + len(self.held) + len(self.unfreed)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or (self.tiers is not None and self.tiers.loading))

    def earliest_waiting_arrival(self) -> float | None:
        return min((s.arrival_ms for s in self.waiting), default=None)

    def sequences(self) -> Iterator[Sequence]:
        yield from self.running
        yield from self.waiting

    # -- one step ----------------------------------------------------------------------------------
    def _cap(self, n: int, budget: int) -> int:
        """Tokens a sequence lacking ``n`` gets of a step: capped by the long-prefill threshold, the budget."""
        threshold = self.limits.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        return min(n, budget)

    def schedule(self, now_ms: float, admit_by_ms: float | None = None) -> ScheduledStep:
        """Plan one step starting at emulated ``now_ms``.

        Only requests that arrived by ``admit_by_ms`` (default ``now_ms``) are admitted: with async
        scheduling the engine passes the previous step's start, when vLLM planned this step.
        """
        step = ScheduledStep(start_ms=now_ms)
        cutoff = now_ms if admit_by_ms is None else admit_by_ms
        budget = self.limits.max_num_batched_tokens
        kv = self.kv
        scheduled: dict[RequestId, int] = {}
        if self.tiers is not None and self.tiers.loading:
            for seq in reversed(self.tiers.collect(now_ms)):  # loads that landed resume first
                self.waiting.appendleft(seq)
        # (c) async: a sequence that stopped on its own last step is computed once more, its token lost.
        for seq in self.unfreed:
            if seq.finish_reason is FinishReason.STOP and budget > 0 and seq.num_tokens < self.limits.max_context:
                step.items.append((seq, 1))
                budget -= 1
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = len(seq.prompt_ids) + len(seq.output_ids) - seq.num_computed_tokens  # ``num_tokens``, inlined
            if n != 1:  # a decode lacks one token, which any budget left (> 0) and any threshold allow
                n = self._cap(n, budget)
            if n <= 0:
                i += 1
                continue
            while not kv.allocate(seq, n):
                victim = self._victim(self.running)
                vi = self.running.index(victim)
                self.running.pop(vi)
                if victim.request_id in scheduled:  # already in this step: its tokens go back
                    budget += scheduled.pop(victim.request_id)
                    step.items = [(q, k) for q, k in step.items if q is not victim]
                    i -= 1
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            step.items.append((seq, n))
            scheduled[seq.request_id] = n
            budget -= n
            i += 1

        if not step.preempted:
            while (self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs
                   and self.waiting[0].arrival_ms <= cutoff):
                seq = self.waiting[0]
                if seq.preloaded:
                    # Its prompt's KV arrived from a prefill engine into blocks it already holds.
                    computed = seq.num_computed_tokens
                    n = self._cap(seq.num_tokens - computed, budget)
                    if not kv.allocate(seq, n):
                        break
                else:
                    prefix = kv.find_prefix(seq)
                    if self.tiers is not None:
                        admit = self.tiers.try_load(seq, prefix)
                        if admit is Admit.BLOCKED:
                            break
                        if admit is Admit.STARTED:  # it waits for its KV while others step
                            self.waiting.popleft()
                            continue
                    computed = prefix.num_tokens(kv.block_size)
                    n = seq.num_tokens - computed
                    threshold = self.limits.long_prefill_token_threshold
                    if 0 < threshold < n:
                        n = threshold
                    if n > budget:
                        if not self.limits.enable_chunked_prefill:
                            break
                        n = budget
                    if not kv.allocate(seq, n, prefix):
                        break
                self.waiting.popleft()
                seq.status = SeqStatus.RUNNING
                seq.num_computed_tokens = computed
                if seq.first_scheduled_ms is None:
                    seq.first_scheduled_ms = now_ms
                    seq.num_cached_prompt_tokens = computed
                    self.stats.prefix_queries += seq.num_prompt_tokens
                    self.stats.prefix_hits += computed - seq.tier_tokens
                    if self.tiers is not None:
                        self.tiers.admitted(seq)
                self.running.append(seq)
                step.items.append((seq, n))
                budget -= n
        # (b) async: blocks of the last step's finishers are freed only now, after this step was planned
        # (a sequence of (c) in this step is done: ``complete`` skips it).
        self._free_unfreed()
        return step

    def _free_unfreed(self) -> None:
        if not self.unfreed:
            return
        for seq in self.unfreed:
            self.kv.free(seq)
        self.unfreed.clear()

    def _preempt(self, seq: Sequence) -> None:
        if self.tiers is not None:
            self.tiers.on_preempt(seq)  # swap: its KV goes to the CPU tier before the blocks are freed
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.preloaded = False  # its transferred KV is gone with its blocks: recompute locally
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def complete(self, step: ScheduledStep, end_ms: float) -> list[TokenOutput]:
        """Apply a finished step: advance progress, cache full blocks, emit tokens, finish sequences."""
        out: list[TokenOutput] = []
        finished: list[Sequence] = []
        stats = self.stats
        cache_full_blocks = self.kv.cache_full_blocks
        next_token = self.next_token
        skip = _NOT_STEPPING
        for seq, n in step.items:
            if seq.status in skip:
                continue  # aborted or paused (migrating) while the step ran, or (c)'s discarded step
            before = seq.num_computed_tokens
            n_prompt = len(seq.prompt_ids)
            computed = seq.num_computed_tokens = before + n
            if before < n_prompt:  # a prefill chunk: count the prompt tokens it computed
                stats.prompt_tokens += min(n, n_prompt - before)
            cache_full_blocks(seq)
            outputs = seq.output_ids
            if computed < n_prompt + len(outputs):
                continue  # a prefill chunk that is not the last
            tok = next_token(seq)
            outputs.append(tok)
            stats.generation_tokens += 1
            if seq.first_token_ms is None:
                seq.first_token_ms = end_ms
            seq.prev_token_ms, seq.last_token_ms = seq.last_token_ms, end_ms
            reason = self._finish_reason(seq)
            out.append(TokenOutput(seq, tok, reason))
            if reason is not None:
                finished.append(seq)
        for seq in finished:
            self.running.remove(seq)
            self._finish(seq, seq.finish_reason or FinishReason.LENGTH)
        if not self.has_work():
            self._free_unfreed()  # no next step is being planned: vLLM processes the outputs at once
        return out

    def _finish_reason(self, seq: Sequence) -> FinishReason | None:
        n = len(seq.output_ids)
        if seq.stop_after is not None and n >= seq.stop_after:
            seq.finish_reason = FinishReason.STOP
        elif n >= seq.max_tokens or seq.num_tokens >= self.limits.max_context:
            seq.finish_reason = FinishReason.LENGTH
        return seq.finish_reason

    def _finish(self, seq: Sequence, reason: FinishReason) -> Sequence:
        seq.finish_reason = reason
        seq.status = SeqStatus.ABORTED if reason is FinishReason.ABORT else SeqStatus.FINISHED
        if seq.hold_blocks and reason is not FinishReason.ABORT:
            self.held[seq.request_id] = seq
        elif self.limits.async_scheduling and reason is not FinishReason.ABORT:
            self.unfreed.append(seq)
        else:
            self.kv.free(seq)
        return seq
