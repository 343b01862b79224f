"""Request-facing KV cache manager over the block pool (vLLM v1's ``KVCacheManager`` in spirit).

Per request it keeps the blocks it holds, finds the longest cached prefix at admission, allocates the
blocks a step needs (all or nothing), records newly full blocks in the prefix cache, and frees blocks
tail first so a request's prefix stays cached longest.

A request's block hashes are computed lazily: at admission only as far as its cached prefix reaches, the
rest as its blocks fill (``cache_full_blocks``, once per prefill chunk), so admitting a 100k-token prompt
does not hash all its 6k blocks in one turn of the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.engine.kv_blocks import BlockPool, KVBlock
from actors.engine.sequence import RequestId, Sequence


@dataclass(frozen=True, slots=True)
class PrefixHit:
    blocks: list[KVBlock]

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size


HASH_BATCH = 32
"""Blocks hashed at a time while looking for a prefix hit (the batch doubles while the hit goes on)."""


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size, enable_caching)
        self.req_blocks: dict[RequestId, list[KVBlock]] = {}
        self._num_cached: dict[RequestId, int] = {}

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_of(self, rid: RequestId) -> list[KVBlock]:
        return self.req_blocks.get(rid, [])

    def find_prefix(self, seq: Sequence) -> PrefixHit:
        """Longest run of cached full blocks at the start of the sequence.

        At least one token is always left to compute (its logits give the next token), so a prompt that
        hits entirely gives back its last block, as vLLM does.
        """
        if not self.pool.enable_caching:
            return PrefixHit([])
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = seq.block_hashes
        hit: list[KVBlock] = []
        while len(hit) < max_blocks:
            i = len(hit)
            if i >= len(hashes):  # hash on only as far as the prefix hits: batches doubling from 32 blocks
                hashes = seq.update_block_hashes(self.block_size, upto=min(max_blocks, i + max(i, HASH_BATCH)))
            b = self.pool.lookup(hashes[i])
            if b is None:
                break
            hit.append(b)
        return PrefixHit(hit)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, prefix: PrefixHit | None = None) -> int:
        """New blocks to hold ``num_new_tokens`` more tokens; with a prefix hit the sequence (not yet
        holding anything) starts after the hit's tokens."""
        held = len(self.req_blocks.get(seq.request_id, ()))
        computed = seq.num_computed_tokens
        if prefix is not None:
            held += len(prefix.blocks)
            computed = prefix.num_tokens(self.block_size)
        total = -(-(computed + num_new_tokens) // self.block_size)
        return max(0, total - held)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixHit | None = None) -> bool:
        need = self.blocks_needed(seq, num_new_tokens, prefix)
        # Prefix blocks sitting in the free queue stop being free once touched.
        revived = sum(1 for b in prefix.blocks if b.ref_cnt == 0) if prefix else 0
        return need <= self.pool.num_free - revived

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Reserve blocks for ``num_new_tokens`` more tokens (after any prefix hit). All or nothing."""
        need = self.blocks_needed(seq, num_new_tokens, prefix)
        if need == 0 and not (prefix and prefix.blocks):
            return True  # a decode inside its last block: the common case, kept cheap
        revived = sum(1 for b in prefix.blocks if b.ref_cnt == 0) if prefix else 0
        if need > self.pool.num_free - revived:
            return False
        held = self.req_blocks.setdefault(seq.request_id, [])
        if prefix and prefix.blocks:
            self.pool.touch(prefix.blocks)
            held.extend(prefix.blocks)
            self._num_cached[seq.request_id] = len(prefix.blocks)
        if need:
            held.extend(self.pool.allocate(need))
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full with computed tokens in the prefix cache."""
        if not self.pool.enable_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        done = self._num_cached.get(seq.request_id, 0)
        if full <= done:
            return
        hashes = seq.update_block_hashes(self.block_size, upto=full)
        blocks = self.req_blocks[seq.request_id]
        parent = hashes[done - 1] if done > 0 else None
        self.pool.cache_blocks(blocks[done:full], hashes[done:full], parent)
        self._num_cached[seq.request_id] = full

    def free(self, seq: Sequence) -> None:
        """Release a request's blocks, tail first, so its prefix is evicted last."""
        blocks = self.req_blocks.pop(seq.request_id, [])
        self._num_cached.pop(seq.request_id, None)
        self.pool.release(reversed(blocks))
