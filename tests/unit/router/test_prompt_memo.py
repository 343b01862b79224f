"""The router's prompt memo (``cluster.router.prompt_memo``): ids and block hashes of text prompts that share
prefixes, reused from earlier prompts, are exactly those of tokenizing and hashing each from scratch."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine.kv_blocks import hash_request_blocks
from actors.engine.tokenizer import Tokenizer
from cluster.loadtest.client import ids_to_text
from cluster.router.choice import Chooser, RoutedRequest
from cluster.router.prompt_memo import PromptMemo
from cluster.router.regions import Topology
from cluster.router.view import ClusterView, RequestContext, RoutingConfig, WorkerInfo
from config.cluster import RouterSpec
from tests.unit.router.conftest import workers

SCRATCH = Tokenizer(32000)
WORD = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FF, blacklist_categories=("Cc", "Cf", "Zs")),
               min_size=1, max_size=9)
SEP = st.sampled_from([" ", " ", " ", "  ", "\n", ""])
"""Mostly single spaces (the memo's case); a double space, a newline or a glued word take the other path."""


def scratch(text: str, bs: int) -> tuple[list[int], list[int]]:
    ids = SCRATCH.encode(text)
    return ids, [int(h) for h in hash_request_blocks(ids, bs)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(WORD, min_size=1, max_size=30), min_size=1, max_size=4),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.lists(WORD, max_size=12), SEP,
                          st.booleans()), min_size=1, max_size=12),
       st.integers(1, 4), st.integers(1, 3), st.integers(1, 3))
def test_memo_answers_are_those_of_tokenizing_from_scratch(
        prefixes: list[list[str]], requests: list[tuple[int, int, list[str], str, bool]], bs: int, stride: int,
        per_key: int) -> None:
    memo = PromptMemo(Tokenizer(32000), bs, stride=stride, max_keys=2, per_key=per_key)
    for which, cut, tail, sep, lead in requests:
        words = prefixes[which % len(prefixes)]
        head = " ".join(words[:cut] if cut else words)  # all of a prefix, or the start of one
        text = (" " if lead else "") + head + (sep + " ".join(tail) if tail else "")
        ids, hashes = memo.encode(text)
        assert (ids, [int(h) for h in hashes]) == scratch(text, bs), text


@settings(max_examples=100, deadline=None)
@given(st.lists(WORD, min_size=1, max_size=60), st.booleans(), st.integers(1, 4), st.integers(1, 3))
def test_each_checkpoint_is_a_word_end_holding_its_tokens(words: list[str], lead: bool, bs: int,
                                                          stride: int) -> None:
    # A checkpoint (chars, tokens): the text's first ``chars`` characters end at a word (a space or the end
    # follows) and are ``tokens`` ids, the last at or before each stride of blocks (ASCII and not).
    text = (" " if lead else "") + " ".join(words)
    memo = PromptMemo(Tokenizer(32000), bs, stride=stride)
    ids, _ = memo.encode(text)
    entries = [e for bucket in memo._buckets.values() for e in bucket]
    if len(ids) // bs < stride:
        assert not entries  # too short to keep
        return
    (entry,) = entries
    assert entry.chars == sorted(set(entry.chars)) and entry.tokens == sorted(set(entry.tokens))
    assert entry.tokens[-1] <= len(ids) // bs * bs
    for chars, tokens in zip(entry.chars, entry.tokens, strict=True):
        assert chars == len(text) or text[chars] == " "
        assert len(SCRATCH.encode(text[:chars])) == tokens


def test_a_hit_reuses_the_shared_prefix_and_a_new_prefix_is_remembered() -> None:
    prefix = ids_to_text(list(range(1000, 3048)))  # bench/router.py's shape: 2048 one-token words
    memo = PromptMemo(Tokenizer(32000), 16)
    first = prefix + ids_to_text(list(range(5000, 5128)))
    assert memo.encode(first) == scratch(first, 16) and memo.misses == 1 and len(memo) == 1
    for k in range(3):
        text = prefix + ids_to_text(list(range(6000 + 128 * k, 6128 + 128 * k)))
        assert memo.encode(text) == scratch(text, 16)
    assert memo.hits == 3 and len(memo) == 1  # hits on the prefix (8 blocks of their own): nothing new to keep
    other = ids_to_text(list(range(9000, 11176)))
    assert memo.encode(other) == scratch(other, 16) and len(memo) == 2


def test_the_memo_is_bounded() -> None:
    memo = PromptMemo(Tokenizer(32000), 4, stride=1, max_keys=3, per_key=2)
    texts = [ids_to_text([k] * 30 + list(range(100 + k, 140 + k))) for k in range(20)]
    for text in texts:
        memo.encode(text)
    assert len(memo) <= 6 and memo.chars == sum(len(t) for t in texts[-3:])  # one per bucket, the last 3 kept
    small = PromptMemo(Tokenizer(32000), 4, stride=1, max_chars=2 * len(texts[0]))
    for text in texts:
        small.encode(text)
    assert len(small) == 2 and small.chars == 2 * len(texts[0])
    small.encode(texts[0] * 3)  # longer than the whole budget: not kept
    assert small.chars <= 2 * len(texts[0])


def chooser(memo: bool) -> tuple[Chooser, list[WorkerInfo]]:
    ws = workers(4)
    view = ClusterView(ws, RoutingConfig(require_feed=False), lambda: 0.0)
    c = Chooser(RouterSpec(policy="kv_aware"), view, Topology(), lambda w, n, cached: n / 100.0, random.Random(0),
                prompt_memo=memo)
    for w in ws:
        c.index.apply_snapshot(w.name, 0, [])
    return c, ws


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40), st.booleans(), st.booleans()), min_size=1,
                max_size=30), st.integers(0, 2**16))
def test_a_chooser_with_the_memo_decides_and_records_as_one_without(
        requests: list[tuple[int, int, bool, bool]], seed: int) -> None:
    # Prompts extend one of 6 prefixes (or the start of one) by fresh words; the engine's events for a
    # request arrive at once or never (its blocks stay in flight).
    runs = [chooser(True), chooser(False)]
    rng = random.Random(seed)
    for k, (prefix, cut, whole, stored) in enumerate(requests):
        ids = [(prefix * 7919 + i) % 17576 for i in range(40 + 16 * prefix)]
        text = ids_to_text((ids if whole else ids[:cut]) + [rng.randrange(17576) for _ in range(rng.randrange(30))])
        body = {"model": "m", "prompt": text, "max_tokens": 8}
        got = []
        for c, ws in runs:
            ctx = RequestContext(body)
            c.prepare(c.policy, ctx, RoutedRequest.of(body, False), ws, defer_tail=True)
            w = c.rank(c.policy, ws, ctx)[0]
            c.routed(c.policy, w, ctx)
            c.complete(ctx)
            if stored:
                c.index.apply(w.name, c.index.last_seq(w.name) + 1,  # type: ignore[operator]
                              [["stored", ctx.block_hashes, None]])
            w.pending_blocks = 0
            got.append((w.name, ctx.prompt_ids, ctx.block_hashes, ctx.overlap))
        assert got[0] == got[1], k
        assert (got[0][1], got[0][2]) == scratch(text, 16)
