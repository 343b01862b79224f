"""Prompt block hashes: the whole-array hashing equals block-by-block chaining bit for bit, and hashing as far
as needed (prefix lookup, blocks as they fill) gives the same hashes and hits as hashing everything at once."""

from __future__ import annotations

import asyncio
import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine.kv_blocks import BlockHash, blake2b_64, hash_block_tokens, hash_request_blocks
from actors.engine.kv_manager import HASH_BATCH, KVCacheManager
from actors.engine.sequence import RequestId, Sequence
from actors.engine.tokenizer import OutputModel, Tokenizer, ids_as_uint32
from actors.server import hash_prompt_in_slices


def chained_one_by_one(tokens: list[int], block_size: int, extra: bytes = b"") -> list[BlockHash]:
    """The reference: ``hash_block_tokens`` per block, each chained to the one before."""
    out: list[BlockHash] = []
    parent: BlockHash | None = None
    for i in range(len(tokens) // block_size):
        parent = hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size], extra)
        out.append(parent)
    return out


tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=300)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300))
def test_block_hash_is_blake2b_of_the_bytes_from_scratch(data: bytes) -> None:
    # the copied empty state must never carry one call's bytes into the next
    assert blake2b_64(data) == int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    assert blake2b_64(data) == blake2b_64(data)


@settings(max_examples=200, deadline=None)
@given(tokens=tokens_st, block_size=st.sampled_from([1, 2, 3, 16]), extra=st.binary(max_size=8),
       split=st.integers(0, 40))
def test_whole_array_hashing_equals_block_by_block(tokens: list[int], block_size: int, extra: bytes,
                                                   split: int) -> None:
    ref = chained_one_by_one(tokens, block_size, extra)
    assert hash_request_blocks(tokens, block_size, extra) == ref
    head = hash_request_blocks(tokens, block_size, extra, limit=split)  # extended later from a known start
    assert head == ref[:split]
    assert hash_request_blocks(tokens, block_size, extra, start=head) == ref


@settings(max_examples=100, deadline=None)
@given(prompt=st.lists(st.integers(0, 999), min_size=1, max_size=400), outputs=st.lists(st.integers(0, 999),
                                                                                       max_size=40),
       upto=st.lists(st.integers(0, 40), max_size=4))
def test_sequence_hashes_incrementally_to_the_same_values(prompt: list[int], outputs: list[int],
                                                          upto: list[int]) -> None:
    seq = Sequence(RequestId("r"), prompt, 64, 0.0, output_ids=list(outputs))
    for n in upto:
        got = seq.update_block_hashes(4, upto=n)
        assert len(got) >= min(n, seq.num_tokens // 4)
    assert seq.update_block_hashes(4) == chained_one_by_one(prompt + outputs, 4)


def test_prefix_lookup_hashes_only_as_far_as_the_hit_and_finds_the_same_prefix() -> None:
    bs = 4
    kv = KVCacheManager(num_blocks=2000, block_size=bs)
    cached_part = list(range(200 * bs))
    first = Sequence(RequestId("a"), [*cached_part, 7], 8, 0.0)
    assert not kv.find_prefix(first).blocks
    assert len(first.block_hashes) == HASH_BATCH  # a miss at the first block: one batch hashed, not 200
    assert kv.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    kv.cache_full_blocks(first)  # hashes computed as the blocks fill
    assert first.block_hashes == chained_one_by_one(first.prompt_ids, bs)

    long = Sequence(RequestId("b"), cached_part + list(range(5000, 5000 + 1000 * bs)), 8, 0.0)
    hit = kv.find_prefix(long)
    assert len(hit.blocks) == 200
    assert 200 < len(long.block_hashes) <= 2 * 200 + HASH_BATCH  # batches double: never all 1200 blocks
    assert long.block_hashes == chained_one_by_one(long.prompt_ids, bs)[:len(long.block_hashes)]


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=50), seed=st.integers(-(2**63), 2**63 - 1))
def test_uint32_bytes_and_prompt_seed_match_numpy(ids: list[int], seed: int) -> None:
    assert ids_as_uint32(ids).tobytes() == np.asarray(ids, dtype=np.uint32).tobytes()
    assert OutputModel(1000).seed_of(ids, seed) == blake2b_64(struct.pack("<q", seed)
                                                        + np.asarray(ids, dtype=np.uint32).tobytes())


def test_valid_ids_bounds_and_types() -> None:
    tok = Tokenizer(100)
    assert tok.valid_ids([]) and tok.valid_ids([0, 99])
    for bad in ([100], [-1], [2**32], [2**70], [1.0], ["1"], [0, None]):
        assert not tok.valid_ids(bad), bad  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(tokens=tokens_st, block_size=st.sampled_from([1, 3, 16]), slice_blocks=st.integers(1, 12))
def test_hashing_in_slices_between_loop_turns_equals_block_by_block(tokens: list[int], block_size: int,
                                                                    slice_blocks: int) -> None:
    got = asyncio.run(hash_prompt_in_slices(tokens, block_size, slice_blocks))
    assert got == chained_one_by_one(tokens, block_size)


def test_hashing_in_slices_lets_the_loop_run_between_slices() -> None:
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    async def run() -> list[BlockHash]:
        ticker = asyncio.ensure_future(count_turns())
        try:
            return await hash_prompt_in_slices(list(range(100 * 16)), 16, slice_blocks=10)
        finally:
            ticker.cancel()

    assert len(asyncio.run(run())) == 100
    assert turns >= 10  # one or more turns after each of the 10 slices


def test_an_engine_refuses_more_block_hashes_than_its_prompt_has() -> None:
    from actors.clock import Clock
    from actors.cost_model import EmpiricalCostModel
    from actors.engine.engine import Engine, EngineConfig
    from actors.engine.scheduler import SchedulerLimits
    from config import default_catalog

    cfg = EngineConfig("e", "lesson", "colocated", 1024, 16, SchedulerLimits(64, 8192, 100_000))
    engine = Engine(cfg, EmpiricalCostModel(default_catalog().profiles.get("lesson-70b-fp8"), "colocated"), Clock(1.0))
    prompt = list(range(40))
    hashes = hash_request_blocks(prompt, engine.cfg.block_size)
    with pytest.raises(ValueError, match="block hashes"):
        engine.submit(prompt, 4, block_hashes=[*hashes, BlockHash(5)])
    seq_hashes = engine.submit(prompt, 4, block_hashes=hashes[:1]).seq.block_hashes  # a head: the engine hashes on
    assert seq_hashes == hashes[:1]
