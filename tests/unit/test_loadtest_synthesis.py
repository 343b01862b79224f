"""Prompt synthesis from hash ids: deterministic, in the vocabulary, sharing exactly the shared blocks."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.loadtest import PromptSynthesizer, ReadOptions, RequestId, RequestSpec, Vocabulary, read_trace
from cluster.loadtest.synthesis import ideal_block_hit_ratio, ideal_block_hit_ratio_of_ids
from tests.conftest import shared_path


def spec(rid: str, n_in: int, ids: tuple[int, ...] = (), bs: int = 16) -> RequestSpec:
    return RequestSpec(RequestId(rid), 0.0, n_in, 1, ids, bs)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_prompts_are_deterministic_and_seeded() -> None:
    s = spec("a", 100, (1, 2, 3, 4, 5, 6, 7))
    assert PromptSynthesizer(0).prompt(s) == PromptSynthesizer(0).prompt(s)
    assert PromptSynthesizer(0).prompt(s) != PromptSynthesizer(1).prompt(s)
    assert len(PromptSynthesizer(0).prompt(s)) == 100


def test_token_ids_stay_in_the_vocabulary_range() -> None:
    p = np.array(PromptSynthesizer(3).prompt(spec("a", 16 * 500, tuple(range(500)))))
    assert p.min() >= 1000 and p.max() < 32000
    assert len(np.unique(p)) > 5000  # spread over the range, not a handful of ids
    q = np.array(PromptSynthesizer(3, Vocabulary(16, 100)).prompt(spec("a", 1000, tuple(range(63)))))
    assert q.min() >= 16 and q.max() < 100
    with pytest.raises(ValueError):
        Vocabulary(10, 10)


def test_block_k_depends_only_on_its_hash_id_and_position() -> None:
    s = PromptSynthesizer(0)
    a = s.prompt(spec("a", 64, (7, 8, 9, 10)))
    b = s.prompt(spec("b", 64, (7, 8, 11, 12)))
    assert a[:32] == b[:32]
    assert a[32:48] != b[32:48]
    assert common_prefix(a, b) < 34  # a collision of a token or two is possible, of a block is not


def test_requests_sharing_ids_but_not_length_share_exactly_the_full_blocks() -> None:
    s = PromptSynthesizer(0)
    full = s.prompt(spec("a", 48, (1, 2, 3)))        # block 2 full
    part = s.prompt(spec("b", 40, (1, 2, 3)))        # block 2 partial (8 tokens)
    part2 = s.prompt(spec("c", 44, (1, 2, 3)))       # block 2 partial (12 tokens)
    assert full[:32] == part[:32] == part2[:32]
    assert common_prefix(full, part) < 34 and common_prefix(part, part2) < 34
    assert s.prompt(spec("d", 40, (1, 2, 3))) == part  # same ids and same length: the same prompt


def test_requests_without_hash_ids_share_nothing() -> None:
    s = PromptSynthesizer(0)
    a, b = s.prompt(spec("x", 64)), s.prompt(spec("y", 64))
    assert common_prefix(a, b) < 3
    assert ideal_block_hit_ratio([np.array(a), np.array(b)], 16) == 0.0
    assert s.prompt(spec("x", 64)) == a


def test_explicit_prompt_is_used_as_is() -> None:
    r = RequestSpec(RequestId("p"), 0.0, 3, 1, prompt_token_ids=(5, 6, 7))
    assert PromptSynthesizer(0).prompt(r) == [5, 6, 7]
    with pytest.raises(ValueError, match="prompt has 3 tokens"):
        RequestSpec(RequestId("p"), 0.0, 4, 1, prompt_token_ids=(5, 6, 7))


def test_ideal_hit_ratio_of_tokens_equals_that_of_ids_on_a_small_trace() -> None:
    specs = [spec("a", 40, (0, 1, 2)), spec("b", 48, (0, 1, 3)), spec("c", 40, (0, 1, 2)),
             spec("d", 20, (0, 4)), spec("e", 16, (5,))]
    s = PromptSynthesizer(0)
    from_tokens = ideal_block_hit_ratio((s.prompt_array(x) for x in specs), 16)
    assert from_tokens == ideal_block_hit_ratio_of_ids(specs) == 6 / 12


def test_mooncake_conversation_trace_hits_36_6_percent_of_blocks() -> None:
    path = shared_path("traces", "mooncake_fast25", "conversation_trace.jsonl")
    trace = read_trace(path, options=ReadOptions(block_size=512))
    synth = PromptSynthesizer(seed=0)
    ratio = ideal_block_hit_ratio((synth.prompt_array(r) for r in trace.requests), 512)
    assert ratio == ideal_block_hit_ratio_of_ids(trace.requests)
    assert round(ratio, 3) == 0.366
