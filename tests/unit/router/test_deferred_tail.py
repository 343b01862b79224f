"""Ranking a cache miss from its prompt's head, the rest tokenized once the request is sent
(``Chooser.prepare(defer_tail=True)`` and ``complete``): the same decisions and the same in-flight records as
tokenizing it all first (no Ray, no sockets)."""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from actors.engine.kv_blocks import hash_request_blocks
from actors.engine.tokenizer import Tokenizer
from cluster.loadtest.client import ids_to_text
from cluster.router.choice import Chooser, RoutedRequest
from cluster.router.exchange import Call
from cluster.router.policies import RoutingPolicy
from cluster.router.regions import Topology
from cluster.router.view import ClusterView, RequestContext, RoutingConfig, WorkerId, WorkerInfo
from config.cluster import RouterSpec
from tests.unit.router.conftest import workers
from tests.unit.router.fakes import Answer, FakeClient, token_events

TOK = Tokenizer(32000)
WORD = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FF, blacklist_categories=("Cc", "Cf", "Zs")),
               min_size=1, max_size=7)


@given(st.booleans(), st.lists(WORD, max_size=60), st.integers(0, 40))
def test_split_head_gives_the_head_of_the_ids_and_the_rest_counts_the_others(lead: bool, words: list[str],
                                                                  head: int) -> None:
    text = (" " if lead else "") + " ".join(words)
    got = TOK.split_head(text, head)
    if text.endswith(" "):  # (" " alone): the regex's cut, not the fast one
        assert got is None
        return
    assert got is not None
    ids, rest = got
    assert text.endswith(rest) and TOK.encode(text[:len(text) - len(rest)]) == ids  # the head, then the rest
    count = len(ids) + TOK.count_after_head(rest)
    full = TOK.encode(text)
    assert count == len(full)
    assert ids == full[:len(ids)] and (len(ids) >= head or ids == full)


def test_split_head_leaves_other_whitespace_to_the_full_path() -> None:
    for text in (" a  b", "a\nb", " a b ", "a\tb"):
        assert TOK.split_head(text, 4) is None


SPACED = st.lists(st.sampled_from(["a", "bc", "defgh", "ijklmnopq", "\u00e9t\u00e9", "x\ty", "!", "~~~~", "n\x00l",
                                   "\x7f", "\x1f"]), max_size=50)


@given(st.sampled_from(["", " "]), SPACED, st.sampled_from([" ", "  ", ""]), st.sampled_from(["", " ", "\n"]),
       st.integers(0, 40))
def test_head_and_count_is_split_head_with_its_rest_counted(lead: str, words: list[str], sep: str, end: str,
                                                            head: int) -> None:
    # One pass over an ASCII text's bytes (others: split_head then count_after_head): the same head and count,
    # and None where split_head gives None (double or trailing spaces, other whitespace or controls).
    text = lead + sep.join(words) + end
    got, ref = TOK.head_and_count(text, head), TOK.split_head(text, head)
    if ref is None:
        assert got is None
        return
    assert got == (ref[0], len(ref[0]) + TOK.count_after_head(ref[1]))
    assert got[1] == len(TOK.encode(text))


def chooser(mode: str) -> tuple[Chooser, RoutingPolicy, list[WorkerInfo]]:
    ws = workers(4)
    view = ClusterView(ws, RoutingConfig(require_feed=False), lambda: 0.0)
    c = Chooser(RouterSpec(policy="kv_aware", index_mode=mode), view, Topology(), lambda w, n, cached: n / 100.0,
                random.Random(0))
    return c, c.policy, ws


def body(prefix: int, rng: random.Random, words: int) -> dict[str, Any]:
    ids = [(prefix * 7919 + k) % 17576 for k in range(words)] + [rng.randrange(17576) for _ in range(20)]
    return {"model": "m", "prompt": ids_to_text(ids), "max_tokens": 8, "stream": True}


Side = tuple[Chooser, RoutingPolicy, list[WorkerInfo]]


def route_both(lazy: Side, eager: Side, a: dict[str, Any], b: dict[str, Any], send_at_once: bool) -> bool:
    """Route body ``a`` through the deferring chooser and the same body ``b`` through the eager one: the same block
    count, overlaps and ranking; once the deferred side is sent (``send_at_once``), the same ids and hashes. Whether
    the deferring side left its tail for after the send."""
    (lc, lp, lws), (ec, ep, ews) = lazy, eager
    ctx_a, ctx_b = RequestContext(a), RequestContext(b)
    lc.prepare(lp, ctx_a, RoutedRequest.of(a, False), lws, defer_tail=True)
    ec.prepare(ep, ctx_b, RoutedRequest.of(b, False), ews)
    assert ctx_a.num_blocks == ctx_b.num_blocks and ctx_a.overlap == ctx_b.overlap
    ra, rb = lc.rank(lp, lws, ctx_a), ec.rank(ep, ews, ctx_b)
    assert [w.name for w in ra] == [w.name for w in rb]
    lc.routed(lp, ra[0], ctx_a)
    ec.routed(ep, rb[0], ctx_b)
    tail_waits = ctx_a.tail is not None
    if send_at_once:
        lc.complete(ctx_a)
        assert ctx_a.prompt_ids == ctx_b.prompt_ids and ctx_a.block_hashes == ctx_b.block_hashes
    return tail_waits


def same_index(lazy: Chooser, eager: Chooser, mode: str, bodies: list[dict[str, Any]], names: list[WorkerId]) -> None:
    """Both choosers' indexes (``mode``'s) give the same overlaps on every worker for each of ``bodies``' prompts."""
    for b in bodies:
        hashes = [int(h) for h in hash_request_blocks(TOK.encode(b["prompt"]), 16)]
        index_a = lazy.approx if mode == "approximate" else lazy.index
        index_b = eager.approx if mode == "approximate" else eager.index
        assert index_a.overlap(hashes, names, 0.0) == index_b.overlap(hashes, names, 0.0)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["events", "approximate"]), st.lists(st.tuples(st.integers(0, 5), st.booleans()),
                                                              min_size=1, max_size=30), st.integers(0, 2**16))
def test_deferred_tails_decide_and_record_as_a_prompt_tokenized_first(
        mode: str, requests: list[tuple[int, bool]], seed: int) -> None:
    # The same requests through a chooser that defers tails and one that does not; a deferred tail is
    # completed at once ("sent") or left for the next request's prepare to flush. Prefix 0's prompts share one
    # full block (a worker that holds it holds exactly the head: the whole prompt is walked), the others more.
    lazy, lazy_policy, lazy_ws = chooser(mode)
    eager, eager_policy, eager_ws = chooser(mode)
    rng_a, rng_b = random.Random(seed), random.Random(seed)
    deferred = 0
    for prefix, send_at_once in requests:
        a, b = body(prefix, rng_a, 20 + 16 * prefix), body(prefix, rng_b, 20 + 16 * prefix)
        deferred += route_both((lazy, lazy_policy, lazy_ws), (eager, eager_policy, eager_ws), a, b, send_at_once)
    lazy.flush()
    assert deferred >= 1  # the first request of a prefix misses everywhere: its tail waited
    # what the index learnt: each prefix's blocks where it was sent
    same_index(lazy, eager, mode, [body(prefix, random.Random(0), 20 + 16 * prefix) for prefix in range(6)],
               [w.name for w in lazy_ws])


def test_a_failed_attempt_leaves_no_in_flight_record_when_its_tail_completes() -> None:
    c, policy, ws = chooser("events")
    b = body(1, random.Random(0), 64)
    ctx = RequestContext(b)
    c.prepare(policy, ctx, RoutedRequest.of(b, False), ws, defer_tail=True)
    assert ctx.tail is not None and not ctx.prompt_ids
    c.routed(policy, c.rank(policy, ws, ctx)[0], ctx)
    c.failed(ctx)  # the connect failed before the request was sent
    c.complete(ctx)
    assert ctx.prompt_ids and ctx.inflight_ticket is None
    assert c.overlap(ctx, ws) == {w.name: 0 for w in ws}


async def test_a_routed_miss_is_tokenized_after_its_send_and_draws_its_prefix_to_the_same_worker(
        make_router: Any, upstream: Any, vclock: Any) -> None:
    ws = workers(3)
    r = await make_router(ws, policy="kv_aware")
    sent_before_tail: list[bool] = []
    for w in ws:
        def script(sent: Any, url: str = w.url) -> Answer:
            # The engine got the request while the router still had the prompt's tail to tokenize.
            sent_before_tail.append(bool(r.chooser._pending))
            return Answer(200, token_events([7, 8], usage=5))
        upstream.engine(w.url, script)
    served = []
    for tail in ("one two", "three four"):  # one long prefix, two endings: a miss, then a hit
        b = body(3, random.Random(0), 200)
        b["prompt"] += " " + tail
        out = FakeClient()
        await vclock.run(r.completions(Call("/v1/completions", CIMultiDict(), json.dumps(b).encode()), out))
        served.append(out.headers["X-Served-By"])
        assert not r.chooser._pending
    assert sent_before_tail == [True, False]  # the hit walked its whole prompt before it was sent
    assert served[0] == served[1]


LONG_WORDS = ("a", "bc", "defgh", "ijklmnopq", "rstu")
"""Words of one to three pieces (with a number): memo checkpoints then fall inside blocks, not on their edges."""


def long_body(prefix: int, suffix: int, words: int) -> dict[str, Any]:
    """A long prompt (so the prompt memo keeps it) made of prefix ``prefix`` and ``words`` words of suffix
    ``suffix`` (the same suffix again: a repeat, whose next block some worker may hold)."""
    def draw(seed: int, n: int) -> list[str]:
        rng = random.Random(seed)
        return [rng.choice(LONG_WORDS) + str(rng.randrange(50)) for _ in range(n)]
    text = " ".join(draw(prefix, 300 + 40 * prefix) + draw(1000 + suffix, words))
    return {"model": "m", "prompt": text, "max_tokens": 8, "stream": True}


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(["events", "approximate"]),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.sampled_from([0, 20, 40, 60]), st.booleans()),
                min_size=1, max_size=25))
def test_a_known_prefix_ranked_before_its_new_part_decides_and_records_as_tokenizing_it_first(
        mode: str, requests: list[tuple[int, int, int, bool]]) -> None:
    # Prompts that extend ones the memo holds (the same prefix, a new or repeated suffix, or a longer one: an
    # earlier prompt extended): ranked from the memo's blocks and the next one when no worker holds that
    # (Chooser._known_head), else walked whole.
    lazy, lazy_policy, lazy_ws = chooser(mode)
    eager, eager_policy, eager_ws = chooser(mode)
    for prefix, suffix, words, send_at_once in requests:
        route_both((lazy, lazy_policy, lazy_ws), (eager, eager_policy, eager_ws), long_body(prefix, suffix, words),
                   long_body(prefix, suffix, words), send_at_once)
    lazy.flush()
    same_index(lazy, eager, mode, [long_body(prefix, suffix, words) for prefix, suffix, words, _ in requests],
               [w.name for w in lazy_ws])


def test_a_known_prefix_with_a_new_part_is_sent_before_the_new_part_is_tokenized() -> None:
    # A 512-token prefix (a memo checkpoint: every 16 blocks) and 40 new words, as the prefix-heavy workload sends.
    c, policy, ws = chooser("events")
    prefix = [(k * 7919) % 17576 for k in range(512)]
    ranked = []
    for suffix, deferred in ((0, True), (1, True), (1, False)):  # a miss; a new ending; the same ending again
        rng = random.Random(suffix)
        text = ids_to_text(prefix + [rng.randrange(17576) for _ in range(40)])
        b: dict[str, Any] = {"model": "m", "prompt": text, "max_tokens": 8, "stream": True}
        ctx = RequestContext(b)
        c.prepare(policy, ctx, RoutedRequest.of(b, False), ws, defer_tail=True)
        assert (ctx.tail is not None) == deferred
        assert ctx.num_tokens == 552 and bool(ctx.prompt_ids) != deferred  # (a deferred prompt: not tokenized yet)
        ranked.append(c.rank(policy, ws, ctx)[0])
        c.routed(policy, ranked[-1], ctx)
        c.complete(ctx)
        assert ctx.prompt_ids == TOK.encode(text)
    assert ranked[0] is ranked[1] is ranked[2]  # the prefix, in flight there, draws the later requests


def test_a_miss_that_shares_only_its_first_block_is_ranked_from_two_blocks_without_walking_it_all() -> None:
    # The first block alone decides a miss; where a candidate holds it, the second block is hashed too, and the
    # prompt is still ranked from its head when no candidate holds both (the rest waits for the send).
    c, policy, ws = chooser("approximate")
    rng = random.Random(1)
    first, second = body(0, rng, 20), body(0, rng, 20)  # 20 shared words: one full block of 16
    ctx = RequestContext(first)
    c.prepare(policy, ctx, RoutedRequest.of(first, False), ws, defer_tail=True)
    assert ctx.tail is not None and not any(ctx.overlap.values())  # a miss, ranked from its first block
    home = c.rank(policy, ws, ctx)[0]
    c.routed(policy, home, ctx)
    c.complete(ctx)
    ctx2 = RequestContext(second)
    c.prepare(policy, ctx2, RoutedRequest.of(second, False), ws, defer_tail=True)
    assert ctx2.tail is not None  # not walked whole before its send
    assert ctx2.overlap == {w.name: 1 if w is home else 0 for w in ws}
    c.complete(ctx2)
    assert len(ctx2.block_hashes) == len(TOK.encode(second["prompt"])) // 16
