"""Hypothesis stateful machine over the KV cache manager and its block pool.

Rules: admit a request (with prefix hits), append tokens, free, preempt (free and reset), re-admit;
eviction happens whenever allocation reuses cached free blocks under a small pool. Invariants after
every step: free + used = total; no block both free and referenced; ref counts never negative and equal
to the number of holders; a referenced block is never evicted (its content hash is unchanged); every
live request holds exactly the blocks its computed tokens need.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from actors.engine.kv_blocks import hash_request_blocks
from actors.engine.kv_manager import KVCacheManager
from actors.engine.sequence import RequestId, Sequence

BS = 2
NUM_BLOCKS = 12
tokens = st.lists(st.integers(1, 3), min_size=1, max_size=10)


class KVMachine(RuleBasedStateMachine):
    live = Bundle("live")
    parked = Bundle("parked")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS)
        self.n = 0
        self.holders: dict[RequestId, Sequence] = {}

    def _admit(self, seq: Sequence) -> bool:
        prefix = self.kv.find_prefix(seq)
        start = prefix.num_tokens(BS)
        if not self.kv.allocate(seq, seq.num_tokens - start, prefix):
            return False
        seq.num_computed_tokens = seq.num_tokens
        self.kv.cache_full_blocks(seq)
        self.holders[seq.request_id] = seq
        return True

    @rule(target=live, toks=tokens)
    def admit(self, toks: list[int]):
        self.n += 1
        seq = Sequence(RequestId(f"r{self.n}"), toks, 100, 0.0)
        return seq if self._admit(seq) else None

    @rule(seq=live, more=st.lists(st.integers(1, 3), min_size=1, max_size=3))
    def append(self, seq: Sequence | None, more: list[int]) -> None:
        if seq is None or seq.request_id not in self.holders:
            return
        before = len(self.kv.blocks_of(seq.request_id))
        seq.output_ids.extend(more)
        if self.kv.allocate(seq, len(more)):
            seq.num_computed_tokens += len(more)
            self.kv.cache_full_blocks(seq)
        else:
            del seq.output_ids[-len(more):]
            assert len(self.kv.blocks_of(seq.request_id)) == before  # all or nothing

    @rule(seq=consumes(live))
    def free(self, seq: Sequence | None) -> None:
        if seq is None or seq.request_id not in self.holders:
            return
        self.kv.free(seq)
        del self.holders[seq.request_id]

    @rule(target=parked, seq=consumes(live))
    def preempt(self, seq: Sequence | None):
        if seq is None or seq.request_id not in self.holders:
            return None
        self.kv.free(seq)
        del self.holders[seq.request_id]
        seq.num_computed_tokens = 0
        return seq

    @rule(target=live, seq=consumes(parked))
    def readmit(self, seq: Sequence | None):
        if seq is None:
            return None
        return seq if self._admit(seq) else None

    @invariant()
    def accounting(self) -> None:
        pool = self.kv.pool
        used = [b for b in pool.blocks if b.ref_cnt > 0]
        assert pool.num_free + len(used) == NUM_BLOCKS
        for b in pool.blocks:
            assert b.ref_cnt >= 0
            assert (b.block_id in pool.free) == (b.ref_cnt == 0)
        held: dict[int, int] = {}
        for rid in self.holders:
            for b in self.kv.blocks_of(rid):
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in pool.blocks:
            assert b.ref_cnt == held.get(b.block_id, 0)
        for h, b in pool.cached.items():
            assert b.block_hash == h

    @invariant()
    def referenced_blocks_keep_their_content(self) -> None:
        for seq in self.holders.values():
            blocks = self.kv.blocks_of(seq.request_id)
            assert len(blocks) == -(-seq.num_computed_tokens // BS)
            chain = hash_request_blocks(seq.all_token_ids()[: seq.num_computed_tokens], BS)
            for b, h in zip(blocks, chain, strict=False):
                assert b.block_hash == h


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(0, 50), min_size=0, max_size=64), st.lists(st.integers(0, 50), max_size=40),
       st.lists(st.integers(0, 50), max_size=40))
def test_equal_prefixes_give_equal_chains(prefix: list[int], a: list[int], b: list[int]) -> None:
    ha = hash_request_blocks(prefix + a, 4)
    hb = hash_request_blocks(prefix + b, 4)
    shared = len(prefix) // 4
    assert ha[:shared] == hb[:shared]
    # Past the first differing block the chains never meet again.
    k = next((i for i, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y), None)
    if k is not None:
        assert not set(ha[k:]) & set(hb[k:])


@given(st.lists(st.integers(0, 50), min_size=4, max_size=64), st.binary(max_size=8), st.binary(max_size=8))
def test_different_extra_keys_give_disjoint_chains(toks: list[int], k1: bytes, k2: bytes) -> None:
    if k1 == k2:
        return
    assert not set(hash_request_blocks(toks, 4, k1)) & set(hash_request_blocks(toks, 4, k2))
