"""The engine's live-migration state machine on the virtual clock (no Ray, no sockets): pause, then either
unpause (the move failed) or hand off to a peer that resumes from the KV it received, and a resume from a
checkpoint that recomputes only the tokens after it. Every case compares the tokens with an uninterrupted
run of the same request (outputs are a pure function of prompt, seed and position)."""

from __future__ import annotations

from typing import Any

from actors.engine.engine import Engine, RequestStream
from actors.engine.sequence import FinishReason, RequestId
from actors.migration import SeqState
from tests.unit.engine.conftest import MakeEngine
from tests.virtual_clock import VirtualClock

PROMPT = list(range(200, 300))  # 100 tokens: six full blocks and a partial one
N = 60


async def take(stream: RequestStream, n: int | None = None) -> tuple[list[int], FinishReason | None]:
    toks: list[int] = []
    async for ev in stream:
        toks.extend(ev.token_ids)
        if ev.finish_reason is not None:
            return toks, ev.finish_reason
        if n is not None and len(toks) >= n:
            break
    return toks, None


async def reference(vclock: VirtualClock, eng: Engine) -> list[int]:
    toks, reason = await vclock.run(take(eng.submit(PROMPT, N, ignore_eos=True, seed=7, request_id="ref")))
    assert reason is FinishReason.LENGTH and len(toks) == N
    return toks


class FirstStep:
    """An observer noting the tokens each step computed per request."""

    def __init__(self) -> None:
        self.items: list[tuple[str, int, int]] = []

    def on_step(self, engine: Engine, step: Any, cost: Any, lag_wall_ms: float) -> None:
        self.items.extend((s.request_id, n, s.num_computed_tokens - n) for s, n in step.items)

    def on_tokens(self, engine: Engine, outputs: Any, end_ms: float) -> None: ...

    def on_finish(self, engine: Engine, seq: Any) -> None: ...


async def test_a_moved_request_goes_on_at_the_next_token_without_recomputing(
        vclock: VirtualClock, make_engine: MakeEngine) -> None:
    src, dst = make_engine(), make_engine()
    for e in (src, dst):
        e.start()
    want = await reference(vclock, src)
    stream = src.submit(PROMPT, N, ignore_eos=True, seed=7, request_id="r")
    first, _ = await vclock.run(take(stream, 20))
    got = src.pause(RequestId("r"))
    assert got is not None
    seq, base = got
    state = SeqState.of(seq, base)
    assert state.output_ids == first and state.computed_tokens == len(PROMPT) + len(first) - 1
    res = dst.reserve(state.prompt_ids, state.max_tokens, request_id="r", lease_ms=1000.0, output_ids=state.output_ids)
    assert res.total_blocks == -(-(len(PROMPT) + len(first)) // 16)
    steps = FirstStep()
    dst.observers.append(steps)
    resumed = dst.admit_resumed(RequestId("r"), state.computed_tokens, state.base, state.stop_after)
    assert src.hand_off(RequestId("r"))
    tail_src, reason_src = await vclock.run(take(stream))
    assert tail_src == [] and reason_src is FinishReason.MIGRATED
    rest, reason = await vclock.run(take(resumed))
    assert reason is FinishReason.LENGTH
    assert first + rest == want  # no token missing or repeated, same sampling state
    assert steps.items[0] == ("r", 1, len(PROMPT) + len(first) - 1)  # a plain decode step: nothing recomputed
    assert not src.paused and src.kv.pool.num_free == src.cfg.num_blocks


async def test_a_failed_move_unpauses_and_the_stream_goes_on_unchanged(
        vclock: VirtualClock, make_engine: MakeEngine) -> None:
    eng = make_engine()
    eng.start()
    want = await reference(vclock, eng)
    stream = eng.submit(PROMPT, N, ignore_eos=True, seed=7, request_id="r")
    first, _ = await vclock.run(take(stream, 10))
    assert eng.pause(RequestId("r")) is not None
    assert eng.pause(RequestId("r")) is None  # paused: not running any more
    vclock.t += 50.0  # time passes while the peer refuses: no token is produced
    assert eng.unpause(RequestId("r"))
    rest, reason = await vclock.run(take(stream))
    assert reason is FinishReason.LENGTH and first + rest == want


async def test_resume_from_a_checkpoint_recomputes_only_the_tokens_after_it(
        vclock: VirtualClock, make_engine: MakeEngine) -> None:
    src, dst = make_engine(), make_engine()
    for e in (src, dst):
        e.start()
    want = await reference(vclock, src)
    stream = src.submit(PROMPT, N, ignore_eos=True, seed=7, request_id="r")
    first, _ = await vclock.run(take(stream, 33))
    seq = stream.seq
    covered = (seq.num_computed_tokens // 16) * 16  # what a checkpoint after token 33 holds: whole blocks
    state = SeqState.of(seq, src.sampling_base(RequestId("r")), covered)
    more, _ = await vclock.run(take(stream, 7))  # the source goes on, then dies
    src.abort(RequestId("r"))
    await vclock.run(take(stream))
    have = first + more  # what the client holds
    dst.reserve(state.prompt_ids, state.max_tokens, request_id="r", lease_ms=1000.0, output_ids=have)
    steps = FirstStep()
    dst.observers.append(steps)
    resumed = dst.admit_resumed(RequestId("r"), state.computed_tokens, state.base, state.stop_after)
    rest, reason = await vclock.run(take(resumed))
    assert reason is FinishReason.LENGTH and have + rest == want
    recomputed = len(PROMPT) + len(have) - covered
    assert steps.items[0] == ("r", recomputed, covered)  # one step: the tokens since the checkpoint, and the next
    assert recomputed < 32 + 16 and dst.scheduler.stats.prompt_tokens == 0  # the prompt was not recomputed
