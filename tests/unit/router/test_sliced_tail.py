"""A deferred miss's tail learns its fresh words a slice per pass of the loop (``Chooser.complete_soon``): other
tasks run between slices, and what it computes is what ``complete`` computes in one go (no Ray, no sockets)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from actors.engine.kv_blocks import hash_request_blocks
from actors.engine.tokenizer import Tokenizer
from cluster.loadtest.client import ids_to_text
from cluster.router.app import RouterServer
from cluster.router.choice import LEARN_SLICE, Chooser, RoutedRequest
from cluster.router.exchange import Call
from cluster.router.view import RequestContext
from tests.unit.router.conftest import workers
from tests.unit.router.fakes import Answer, FakeClient, FakeUpstream, token_events
from tests.unit.router.test_deferred_tail import SPACED, chooser


def miss(seed: int, words: int) -> dict[str, Any]:
    """A prompt of ``words`` random words (mostly new to a fresh tokenizer: a new prefix's first request)."""
    rng = random.Random(seed)
    return {"model": "m", "prompt": ids_to_text([rng.randrange(17576) for _ in range(words)]), "max_tokens": 8,
            "stream": True}


def routed_miss(c: Chooser, b: dict[str, Any]) -> RequestContext:
    ctx = RequestContext(b)
    c.prepare(c.policy, ctx, RoutedRequest.of(b, False), sorted(c.view.workers.values(), key=lambda w: w.name),
              defer_tail=True)
    assert ctx.tail is not None and not ctx.prompt_ids  # ranked from its head
    c.routed(c.policy, c.rank(c.policy, sorted(c.view.workers.values(), key=lambda w: w.name), ctx)[0], ctx)
    return ctx


async def test_a_miss_tail_lets_the_loop_run_between_slices_and_computes_what_complete_does() -> None:
    lazy, _, ws = chooser("events")
    eager, _, _ = chooser("events")
    b = miss(1, 3 * LEARN_SLICE + 40)
    ctx, ref = routed_miss(lazy, b), routed_miss(eager, b)
    turns = 0

    async def other() -> None:  # another request's work on the same loop
        nonlocal turns
        while ctx.tail is not None:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(other())
    await lazy.complete_soon(ctx)
    await task
    eager.complete(ref)
    assert turns >= 4  # the loop ran the other task between the slices
    assert ctx.tail is None and not lazy._pending
    assert ctx.prompt_ids == ref.prompt_ids == Tokenizer(32000).encode(b["prompt"])
    assert ctx.block_hashes == ref.block_hashes
    hashes, names = ref.block_hashes, [w.name for w in ws]
    assert lazy.index.overlap(hashes, names, 0.0) == eager.index.overlap(hashes, names, 0.0)  # the same in-flight
    assert max(lazy.index.overlap(hashes, names, 0.0).values()) == len(hashes)
    assert len(lazy.memo(ws[0].vocab_size, ws[0].block_size)) == len(eager.memo(ws[0].vocab_size, ws[0].block_size)) \
        == 1  # the memo learnt the prompt as from complete


async def test_a_request_ranked_between_two_slices_completes_the_tail_first() -> None:
    c, _, ws = chooser("events")
    first = routed_miss(c, miss(2, 4 * LEARN_SLICE))
    task = asyncio.get_running_loop().create_task(c.complete_soon(first))
    await asyncio.sleep(0)  # one slice learnt
    assert first.tail is not None and not task.done()
    second = RequestContext(miss(2, 4 * LEARN_SLICE))  # the same prompt again: its prepare flushes the first's tail
    c.prepare(c.policy, second, RoutedRequest.of(second.body, False), ws, defer_tail=True)
    assert first.tail is None and first.prompt_ids == Tokenizer(32000).encode(first.text)
    await task  # the slices stop; nothing is completed twice
    assert first.routed_to is not None and c.inflight is not None
    assert c.index.overlap(first.block_hashes, [first.routed_to], 0.0)[first.routed_to] == len(first.block_hashes)
    assert len(c.inflight) == len(first.block_hashes)  # one record: the flush's
    assert second.tail is None and second.overlap[first.routed_to] == len(first.block_hashes)  # (walked whole)


def test_a_request_for_another_prefix_does_not_wait_for_a_pending_tail() -> None:
    # A record counts leading blocks, chained from the first: a prompt that starts with another block can use
    # none of a pending miss's record, so its prepare leaves that tail pending; one that starts alike completes it.
    c, _, ws = chooser("events")
    first = routed_miss(c, miss(4, 300))
    other = routed_miss(c, miss(5, 300))
    assert first.tail is not None and other.tail is not None and len(c._pending) == 2
    again = RequestContext(miss(4, 300))
    c.prepare(c.policy, again, RoutedRequest.of(again.body, False), ws, defer_tail=True)
    assert first.tail is None and other.tail is not None and c._pending == [other]
    assert again.tail is None and max(again.overlap.values()) == len(again.block_hashes)  # the first's record
    c.flush()


@given(st.sampled_from(["", " "]), SPACED, st.sampled_from([" ", "  "]), st.integers(1, 7))
def test_encode_pieces_join_to_encode(lead: str, words: list[str], sep: str, per: int) -> None:
    text = lead + sep.join(words)
    pieces = list(Tokenizer(32000).encode_pieces(text, per))
    assert [i for piece in pieces for i in piece] == Tokenizer(32000).encode(text)
    if Tokenizer.spaced(text):
        assert all(len(piece) <= 3 * per for piece in pieces)  # (a word is at most 3 pieces here)


class _Watching(FakeClient):
    """A client that notes, at each write, how many deferred tails its router still has pending."""

    def __init__(self, router: RouterServer) -> None:
        super().__init__()
        self.router = router
        self.pending_at_write: list[int] = []

    async def write(self, data: bytes) -> None:
        self.pending_at_write.append(len(self.router.chooser._pending))
        await super().write(data)


async def test_a_miss_is_relayed_while_its_tail_is_still_pending_and_the_tail_ends_with_the_attempt(
        make_router: Callable[..., Awaitable[RouterServer]], upstream: FakeUpstream) -> None:
    # The engine answers at once; the relay no longer waits for the tail (Chooser.tail_meanwhile): the first
    # event reaches the client while the tail is pending, and by the end of the request it is complete and
    # recorded as ``complete`` records it.
    ws = workers(2)
    for w in ws:
        upstream.engine(w.url, lambda s: Answer(parts=token_events([5, 6], usage=3)))
    r = await make_router(ws, policy="kv_aware")
    b = miss(7, 4 * LEARN_SLICE)
    out = _Watching(r)
    assert await r.route(Call("/v1/completions", CIMultiDict({"Content-Type": "application/json"}),
                              json.dumps(b).encode(), {}), out, False) is None
    assert out.token_ids() == [5, 6] and out.pending_at_write[0] == 1  # relayed before the tail was done
    assert not r.chooser._pending  # completed when the attempt ended
    ids = Tokenizer(32000).encode(b["prompt"])
    hashes = hash_request_blocks(ids, ws[0].block_size)
    served = next(w.name for w in ws if upstream.to(w.url))
    assert r.chooser.approx.overlap(hashes, [served], 0.0)[served] == len(hashes)  # the whole prompt recorded


async def test_a_streamed_miss_tail_waits_for_its_first_token(
        make_router: Callable[..., Awaitable[RouterServer]], upstream: FakeUpstream) -> None:
    # While the engine prefills (here: silent until the test sets ``prefill``) the router learns none of the
    # miss's words past its head: the engine is busy with the same prompt (``Chooser.tail_meanwhile``). Once the
    # first token is relayed the tail runs, and by the end of the request it is recorded as ``complete`` does.
    ws = workers(2)
    prefill = asyncio.Event()
    for w in ws:
        upstream.engine(w.url, lambda s: Answer(parts=[prefill, *token_events([5, 6], usage=3)]))
    r = await make_router(ws, policy="kv_aware")
    b = miss(8, 4 * LEARN_SLICE)
    out = FakeClient()
    call = Call("/v1/completions", CIMultiDict({"Content-Type": "application/json"}), json.dumps(b).encode(), {})
    task = asyncio.get_running_loop().create_task(r.route(call, out, False))
    tok = r.chooser._tokenizer(ws[0].vocab_size)
    words = set(b["prompt"].split(" ")) - {""}
    try:
        for _ in range(4 * LEARN_SLICE):  # many passes of the loop: as many slices as the tail holds, and more
            await asyncio.sleep(0)
        assert out.started and out.token_ids() == [] and len(r.chooser._pending) == 1  # prefilling; tail pending
        assert sum(w in tok._after_space for w in words) <= 2 * ws[0].block_size  # the head's words alone
    finally:
        prefill.set()
        assert await task is None
    assert out.token_ids() == [5, 6] and not r.chooser._pending
    assert all(w in tok._after_space for w in words)
    hashes = hash_request_blocks(Tokenizer(32000).encode(b["prompt"]), ws[0].block_size)
    served = next(w.name for w in ws if upstream.to(w.url))
    assert r.chooser.approx.overlap(hashes, [served], 0.0)[served] == len(hashes)  # the whole prompt recorded
