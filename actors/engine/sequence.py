"""A request as the engine tracks it."""

from __future__ import annotations

import enum
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import NewType, overload

from actors.engine.kv_blocks import BlockHash, hash_request_blocks

RequestId = NewType("RequestId", str)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    PAUSED = "paused"
    """Out of the step loop with its blocks kept, while its KV moves to another engine (live migration)."""


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    MIGRATED = "migrated"
    """The request goes on on another engine (live migration): this engine's stream of it ends here."""


class _Joined(SequenceABC[int]):
    """``head + tail`` read in place: hashing the block a decode just filled must not copy the whole context
    (a 9k-token sequence's decode stretch spent 40% of its time in that copy)."""

    __slots__ = ("head", "tail")

    def __init__(self, head: list[int], tail: list[int]) -> None:
        self.head = head
        self.tail = tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        n = len(self.head)
        if isinstance(i, int):
            i = i + len(self) if i < 0 else i
            return self.head[i] if i < n else self.tail[i - n]
        start, stop, stride = i.indices(len(self))
        if stride != 1:
            return [self[k] for k in range(start, stop, stride)]
        return self.head[start:min(stop, n)] + self.tail[max(0, start - n):max(0, stop - n)]


@dataclass(eq=False)
class Sequence:
    """One request: its prompt, what it has generated, how much of it the KV cache holds.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (computed or hit). A decoding sequence
    always has exactly one uncomputed token (the last one generated), which the next step computes.
    Preemption by recompute sets ``num_computed_tokens`` back to 0; prompt and outputs are kept.
    """

    request_id: RequestId
    prompt_ids: list[int]
    max_tokens: int
    arrival_ms: float
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    stop_after: int | None = None
    """Natural end (the emulated model's EOS) after this many tokens; None with ignore_eos."""
    extra_keys: bytes = b""
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_preemptions: int = 0
    first_scheduled_ms: float | None = None
    first_token_ms: float | None = None
    last_token_ms: float | None = None
    prev_token_ms: float | None = None
    finish_reason: FinishReason | None = None
    num_cached_prompt_tokens: int = 0
    hold_blocks: bool = False
    """Keep the KV blocks after finishing (a prefill whose KV a decode engine will take) until released."""
    preloaded: bool = False
    """The prompt's KV is already in this sequence's blocks (it arrived from a prefill engine)."""
    priority: int = 0
    """Scheduling priority under the ``priority`` policy: lower runs first (as vLLM)."""
    tier_tokens: int = 0
    """Tokens of its KV loaded from a tier below the GPU (CPU, disk, store) rather than computed or hit."""
    swap_tokens: int = 0
    """Swapped out at preemption: this many computed tokens' KV went to the CPU tier, to be loaded back."""
    skip_tiers: bool = False
    """A tier load failed: recompute (set back at the next preemption)."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def update_block_hashes(self, block_size: int, upto: int | None = None) -> list[BlockHash]:
        """Hashes of the full blocks of prompt + outputs: every one, or (``upto``) at least the first ``upto``.

        Incremental: only blocks not hashed yet are hashed, so a long prompt's hashes can be computed as its
        chunks are prefilled (``KVCacheManager.cache_full_blocks``) rather than all at admission.
        """
        n = self.num_tokens // block_size
        if upto is not None:
            n = min(n, upto)
        if len(self.block_hashes) < n:
            end = n * block_size
            tokens = self.prompt_ids if end <= len(self.prompt_ids) else _Joined(self.prompt_ids, self.output_ids)
            self.block_hashes = hash_request_blocks(tokens, block_size, self.extra_keys, start=self.block_hashes,
                                                    limit=n)
        return self.block_hashes

    @property
    def is_decoding(self) -> bool:
        return bool(self.output_ids) and self.num_computed_tokens == self.num_tokens - 1

    @property
    def done(self) -> bool:
        return self.status in (SeqStatus.FINISHED, SeqStatus.ABORTED)
