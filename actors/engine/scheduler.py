"""The step scheduler: FCFS waiting queue, running set, token budget, chunked prefill, preemption.

As vLLM v1 schedules one step:
1. Running sequences first, in order: each gets the tokens it still lacks (1 for a decode, the rest
   of its prompt for a prefill, capped by the step's token budget). If its blocks cannot be allocated,
   the *last* running sequence is preempted by recompute (blocks freed, progress reset, back to the
   front of the waiting queue) until the allocation fits or the sequence itself was preempted.
2. Then, if nothing was preempted this step, waiting sequences in arrival order while budget,
   ``max_num_seqs`` and KV blocks allow; each starts after its longest cached prefix.
3. The step's shape (prefill chunks with their context, decodes with theirs) goes to the cost model.

After the step (``complete``), each sequence's computed count advances; one whose tokens are all
computed emits a token; a sequence that reaches ``max_tokens``, its natural end or the context limit
finishes and frees its blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from actors.cost_model import StepShape
from actors.engine.kv_manager import KVCacheManager
from actors.engine.sequence import FinishReason, RequestId, SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_context: int
    enable_chunked_prefill: bool = True


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
            if n == 1 and seq.is_decoding:
                decodes.append(seq.num_computed_tokens + 1)
            else:
                prefills.append((n, seq.num_computed_tokens))
        return StepShape.of(prefills, decodes)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


@dataclass(frozen=True, slots=True)
class TokenOutput:
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
    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager,
                 next_token: Callable[[Sequence], int]) -> None:
        self.limits = limits
        self.kv = kv
        self.next_token = next_token
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[RequestId, Sequence] = {}
        """Finished sequences whose blocks are kept for a transfer (``hold_blocks``), until ``release``."""
        self.stats = SchedulerStats()

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
        return len(self.running) + len(self.held)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def earliest_waiting_arrival(self) -> float | None:
        return min((s.arrival_ms for s in self.waiting), default=None)

    def sequences(self) -> Iterator[Sequence]:
        yield from self.running
        yield from self.waiting

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self, now_ms: float) -> ScheduledStep:
        """Plan one step starting at emulated ``now_ms`` (only requests that have arrived are admitted)."""
        step = ScheduledStep(start_ms=now_ms)
        budget = self.limits.max_num_batched_tokens
        kv = self.kv
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while not kv.allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            step.items.append((seq, n))
            budget -= n
            i += 1

        if not step.preempted:
            while (self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs
                   and self.waiting[0].arrival_ms <= now_ms):
                seq = self.waiting[0]
                if seq.preloaded:
                    # Its prompt's KV arrived from a prefill engine into blocks it already holds.
                    computed = seq.num_computed_tokens
                    n = min(seq.num_tokens - computed, budget)
                    if not kv.allocate(seq, n):
                        break
                else:
                    prefix = kv.find_prefix(seq)
                    computed = prefix.num_tokens(kv.block_size)
                    n = seq.num_tokens - computed
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
                    self.stats.prefix_hits += computed
                self.running.append(seq)
                step.items.append((seq, n))
                budget -= n
        return step

    def _preempt(self, seq: Sequence) -> None:
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
        for seq, n in step.items:
            if seq.done:
                continue  # aborted while the step ran
            was_prefill = seq.num_computed_tokens < seq.num_prompt_tokens
            seq.num_computed_tokens += n
            if was_prefill:
                self.stats.prompt_tokens += min(n, max(0, seq.num_prompt_tokens - (seq.num_computed_tokens - n)))
            self.kv.cache_full_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that is not the last
            tok = self.next_token(seq)
            seq.output_ids.append(tok)
            self.stats.generation_tokens += 1
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
        return out

    def _finish_reason(self, seq: Sequence) -> FinishReason | None:
        n = len(seq.output_ids)
        if seq.stop_after is not None and n >= seq.stop_after:
            seq.finish_reason = FinishReason.STOP
        elif n >= seq.max_tokens or seq.num_tokens >= self.limits.max_context:
            seq.finish_reason = FinishReason.LENGTH
        return seq.finish_reason

    def _finish(self, seq: Sequence, reason: FinishReason) -> Sequence:
        if seq.hold_blocks and reason is not FinishReason.ABORT:
            seq.finish_reason = reason
            seq.status = SeqStatus.FINISHED
            self.held[seq.request_id] = seq
            return seq
        self.kv.free(seq)
        seq.finish_reason = reason
        seq.status = SeqStatus.ABORTED if reason is FinishReason.ABORT else SeqStatus.FINISHED
        return seq
