"""The engine's step loop on the shared virtual clock, without Ray or sockets.

Each scenario runs under ``VirtualClock.run``: emulated time jumps to the next deadline (a step's end, a
lease's end) whenever every task waits on it, so timings are exact and nothing sleeps in wall time. The
``make_engine`` fixture stops each engine and checks that no task, sequence, lease or KV block is left.
"""

from __future__ import annotations

import asyncio

import pytest

from actors.engine.engine import EngineError, RequestStream
from actors.engine.sequence import FinishReason
from tests.unit.engine.conftest import MakeEngine
from tests.virtual_clock import VirtualClock


async def collect(stream: RequestStream) -> tuple[list[int], FinishReason | None]:
    toks: list[int] = []
    reason = None
    async for ev in stream:
        toks.extend(ev.token_ids)
        reason = ev.finish_reason
    return toks, reason


async def test_emulated_timeline_follows_the_cost_model_exactly(vclock: VirtualClock,
                                                                make_engine: MakeEngine) -> None:
    eng = make_engine()
    eng.start()
    s = eng.submit(list(range(100, 4100)), 5, ignore_eos=True)
    toks, reason = await vclock.run(collect(s))
    seq = s.seq
    assert len(toks) == 5 and reason is FinishReason.LENGTH
    assert seq.first_scheduled_ms == 0.0  # an idle engine starts the request when it arrives
    assert seq.first_token_ms is not None and seq.last_token_ms is not None
    # 4000 prompt tokens at 40 tokens/ms, then four 10 ms decode steps on absolute deadlines.
    assert seq.first_token_ms == pytest.approx(100.0)
    assert seq.last_token_ms - seq.first_token_ms == pytest.approx(40.0)
    assert vclock.now_ms() == seq.last_token_ms  # the last token arrives when its step ends
    assert eng.lag.count == 5 and eng.lag.summary()["max"] == 0.0  # a virtual clock is never late


async def test_many_concurrent_requests_complete_and_free_every_block(vclock: VirtualClock,
                                                                      make_engine: MakeEngine) -> None:
    eng = make_engine(blocks=512, budget=2048, seqs=16)
    events: list[tuple[int, list]] = []
    eng.kv_subscribers.append(lambda n, ev: events.append((n, ev)))
    eng.start()
    streams = [eng.submit([1000 + i % 5] * 64 + list(range(i, i + 40)), 8 + i % 7, ignore_eos=True)
               for i in range(40)]

    async def scenario() -> list[tuple[list[int], FinishReason | None]]:
        return await asyncio.gather(*(collect(s) for s in streams))

    results = await vclock.run(scenario())
    for i, (toks, reason) in enumerate(results):
        assert len(toks) == 8 + i % 7 and reason is FinishReason.LENGTH
    assert eng.kv.pool.num_free == 512
    assert eng.num_running == 0 and eng.num_waiting == 0
    assert eng.scheduler.stats.prefix_hits > 0  # the five shared 64-token heads were reused
    assert [n for n, _ in events] == list(range(1, len(events) + 1))  # sequence numbers have no gaps
    assert vclock.now_ms() == max(s.seq.last_token_ms or 0.0 for s in streams)


async def test_abort_frees_the_sequence_and_its_blocks(vclock: VirtualClock, make_engine: MakeEngine) -> None:
    eng = make_engine()
    eng.start()
    s = eng.submit(list(range(100, 400)), 10_000, ignore_eos=True)

    async def scenario() -> int:
        got = 0
        async for ev in s:
            got += len(ev.token_ids)
            if got >= 3:
                break
        s.abort()
        return got

    assert await vclock.run(scenario()) == 3
    assert eng.kv.pool.num_free == 4096 and eng.num_running == 0


async def test_outputs_are_deterministic_per_prompt_and_seed(vclock: VirtualClock,
                                                             make_engine: MakeEngine) -> None:
    eng = make_engine()
    eng.start()
    p = list(range(200, 260))

    async def scenario() -> None:
        a, _ = await collect(eng.submit(p, 6, ignore_eos=True, seed=1))
        b, _ = await collect(eng.submit(p, 6, ignore_eos=True, seed=1))
        c, _ = await collect(eng.submit(p, 6, ignore_eos=True, seed=2))
        assert a == b and a != c
        natural, reason = await collect(eng.submit(p, 100_000 - 61, seed=1))
        assert reason is FinishReason.STOP and 16 <= len(natural) <= 512

    await vclock.run(scenario())


async def test_impossible_requests_are_refused_at_submission(make_engine: MakeEngine) -> None:
    eng = make_engine(blocks=4)
    with pytest.raises(EngineError, match="empty"):
        eng.submit([], 5)
    with pytest.raises(EngineError, match="maximum context length is 100000"):
        eng.submit([1] * 99_999, 5)
    with pytest.raises(EngineError, match="needs 7 KV blocks"):
        eng.submit([1] * 100, 5)
    with pytest.raises(EngineError, match="max_tokens"):
        eng.submit([1, 2], 0)


async def test_a_prefill_holds_its_blocks_until_released_or_its_lease_ends(vclock: VirtualClock,
                                                                           make_engine: MakeEngine) -> None:
    eng = make_engine(blocks=64)
    eng.start()

    async def scenario() -> None:
        s = eng.submit(list(range(100, 180)), 1, ignore_eos=True, hold_blocks_ms=1e9)
        toks, _ = await collect(s)
        assert len(toks) == 1
        assert eng.kv.pool.num_free == 64 - 5  # the 80 prompt tokens' KV, held in 5 blocks
        assert eng.release(s.request_id) and eng.kv.pool.num_free == 64
        assert not eng.release(s.request_id)
        s2 = eng.submit(list(range(300, 380)), 1, ignore_eos=True, hold_blocks_ms=20.0)
        await collect(s2)
        assert s2.seq.last_token_ms is not None
        lease_end = s2.seq.last_token_ms + 20.0  # 20 emulated ms after the prefill finished
        await vclock.sleep_until(lease_end - 0.001)
        assert eng.kv.pool.num_free == 64 - 5 and eng.lease_expiries == 0
        await vclock.sleep_until(lease_end)
        assert eng.kv.pool.num_free == 64 and eng.lease_expiries == 1

    await vclock.run(scenario())


async def test_a_decode_reserves_then_admits_the_prefills_kv_and_continues_its_tokens(
        vclock: VirtualClock, make_engine: MakeEngine) -> None:
    eng = make_engine(blocks=64)
    colocated = make_engine(blocks=64)
    eng.start()
    colocated.start()

    async def scenario() -> None:
        prompt = list(range(100, 180))
        reference, _ = await collect(colocated.submit(prompt, 6, ignore_eos=True, seed=3))
        res = eng.reserve(prompt, 6, request_id="r1", lease_ms=1e6)
        assert (res.cached_blocks, res.total_blocks) == (0, 5)
        assert eng.kv.pool.num_free == 59
        with pytest.raises(EngineError, match="no room") as ei:
            eng.reserve(list(range(1000, 2000)), 6, request_id="r2", lease_ms=1e6)
        assert ei.value.status == 409
        s = eng.admit_preloaded(res.request_id, reference[0], ignore_eos=True, seed=3)
        toks, _ = await collect(s)
        assert [reference[0], *toks] == reference  # the decode continues the same token sequence
        assert eng.scheduler.stats.prompt_tokens == 0  # no prefill work on the decode engine
        assert eng.kv.pool.num_free == 64
        # A prompt the decode engine already caches needs no transfer for those blocks.
        reserved_at = vclock.now_ms()
        again = eng.reserve(prompt + [7] * 20, 4, request_id="r3", lease_ms=10.0)
        assert again.cached_blocks == 5
        await vclock.sleep_until(reserved_at + 9.999)
        assert eng.reserved and eng.kv.pool.num_free < 64 and eng.lease_expiries == 0
        await vclock.sleep_until(reserved_at + 10.0)
        assert not eng.reserved and eng.kv.pool.num_free == 64 and eng.lease_expiries == 1  # the lease lapsed
        with pytest.raises(EngineError, match="no reservation"):
            eng.admit_preloaded(again.request_id, 5)

    await vclock.run(scenario())


async def test_the_prefill_backlog_counts_what_is_left_to_compute(vclock: VirtualClock,
                                                                  make_engine: MakeEngine) -> None:
    eng = make_engine(budget=512)
    a = eng.submit(list(range(100, 1100)), 4, ignore_eos=True)
    b = eng.submit(list(range(2000, 2300)), 4, ignore_eos=True)
    assert eng.prefill_backlog_tokens() == 999 + 299  # queued, not started: every prompt token but the last
    assert eng.load()["prefill_backlog_tokens"] == 1298
    after_steps: list[int] = []
    eng.change_listeners.append(lambda: after_steps.append(eng.prefill_backlog_tokens()))
    eng.start()

    async def scenario() -> None:
        await asyncio.gather(collect(a), collect(b))

    await vclock.run(scenario())
    assert after_steps[0] == 1298 - 512  # one 512-token chunk computed in the first step
    assert after_steps == sorted(after_steps, reverse=True)  # no arrivals: the backlog only shrinks
    assert after_steps[-1] == eng.prefill_backlog_tokens() == 0


