"""Block pool and KV cache manager: small scenarios with exact block ids and eviction order."""

from __future__ import annotations

import pytest

from actors.engine.kv_blocks import (
    AllBlocksCleared,
    BlockHash,
    BlockPool,
    BlockRemoved,
    BlockStored,
    NoFreeBlocks,
    hash_block_tokens,
    hash_request_blocks,
)
from actors.engine.kv_manager import KVCacheManager
from actors.engine.sequence import RequestId, Sequence


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_allocation_is_lru_and_eviction_emits_removed() -> None:
    pool = BlockPool(4, block_size=2)
    a = pool.allocate(2)
    assert ids(a) == [0, 1]
    pool.cache_blocks(a, [BlockHash(10), BlockHash(11)], None)
    assert pool.take_events() == [BlockStored((BlockHash(10), BlockHash(11)), None, 2)]
    pool.release(reversed(a))  # tail first: block 1 becomes the older free block
    assert list(pool.free) == [2, 3, 1, 0]
    b = pool.allocate(3)
    assert ids(b) == [2, 3, 1]
    assert pool.take_events() == [BlockRemoved((BlockHash(11),))]
    assert pool.lookup(BlockHash(11)) is None
    hit = pool.lookup(BlockHash(10))
    assert hit is not None and hit.block_id == 0
    pool.touch([hit])
    assert pool.num_free == 0 and hit.ref_cnt == 1
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)


def test_shared_block_is_freed_only_by_its_last_holder() -> None:
    pool = BlockPool(3, block_size=4)
    (blk,) = pool.allocate(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.release([blk])
    assert blk.block_id not in pool.free
    pool.release([blk])
    assert list(pool.free)[-1] == blk.block_id
    with pytest.raises(AssertionError):
        pool.release([blk])


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(2, block_size=2)
    a = pool.allocate(1)
    pool.cache_blocks(a, [BlockHash(5)], None)
    assert pool.reset_prefix_cache() is False
    pool.release(a)
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(BlockHash(5)) is None
    assert isinstance(pool.take_events()[-1], AllBlocksCleared)


def test_hash_chains() -> None:
    toks = list(range(40))
    h = hash_request_blocks(toks, 16)
    assert len(h) == 2
    assert h[0] == hash_block_tokens(None, toks[:16])
    assert h[1] == hash_block_tokens(h[0], toks[16:32])
    assert hash_request_blocks(toks[:33], 16) == h
    other = hash_request_blocks(toks, 16, extra_keys=b"lora-1")
    assert not set(other) & set(h)
    changed = hash_request_blocks([99, *toks[1:]], 16)
    assert changed[0] != h[0] and changed[1] != h[1]  # a changed parent changes every child


def seq(rid: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(RequestId(rid), tokens, max_tokens, arrival_ms=0.0)


def test_manager_prefix_hit_reuses_blocks_and_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(8, block_size=2)
    a = seq("a", [1, 2, 3, 4, 5])
    assert kv.find_prefix(a).blocks == []
    assert kv.allocate(a, 5)
    assert ids(kv.blocks_of(a.request_id)) == [0, 1, 2]
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    stored = kv.pool.take_events()
    assert stored == [BlockStored(tuple(a.block_hashes[:2]), None, 2)]

    b = seq("b", [1, 2, 3, 4, 5, 6, 7])
    hit = kv.find_prefix(b)
    assert ids(hit.blocks) == [0, 1] and hit.num_tokens(2) == 4
    b.num_computed_tokens = 0
    assert kv.blocks_needed(b, 3, hit) == 2
    assert kv.allocate(b, 3, hit)
    b.num_computed_tokens = 4  # the scheduler sets this from the hit
    assert ids(kv.blocks_of(b.request_id)) == [0, 1, 3, 4]
    assert [blk.ref_cnt for blk in kv.blocks_of(b.request_id)] == [2, 2, 1, 1]

    # A prompt that is entirely cached still computes its last token: its last block is not a hit.
    c = seq("c", [1, 2, 3, 4])
    assert ids(kv.find_prefix(c).blocks) == [0]


def test_manager_free_is_tail_first_and_allocation_is_all_or_nothing() -> None:
    kv = KVCacheManager(4, block_size=2)
    a = seq("a", [1, 2, 3, 4, 5, 6])
    assert kv.allocate(a, 6)
    assert not kv.allocate(seq("b", [9] * 4), 4)  # needs 2, only 1 free: nothing taken
    assert kv.pool.num_free == 1
    kv.free(a)
    assert list(kv.pool.free) == [3, 2, 1, 0]
    assert kv.pool.num_free == 4
