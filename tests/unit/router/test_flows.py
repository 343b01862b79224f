"""The router's mechanism against fake engines on a virtual clock: retries, 429, deadlines, breakers,
migration, client disconnects, read timeouts (no Ray, no sockets)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import pytest
from multidict import CIMultiDict

from cluster.router.app import RouterServer
from cluster.router.exchange import Call, Whole
from cluster.router.upstream import UpstreamError
from cluster.router.view import WorkerInfo
from config.cluster import RouterSpec
from tests.unit.router.conftest import workers
from tests.unit.router.fakes import STALL, Answer, FakeClient, FakeResponse, FakeUpstream, Sent, token_events
from tests.virtual_clock import VirtualClock

MakeRouter = Callable[..., Awaitable[RouterServer]]


def call(body: dict[str, Any], **headers: str) -> Call:
    return Call("/v1/completions", CIMultiDict(headers), json.dumps(body).encode())


def streamed(prompt: list[int], max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


def tokens(*ids: int, **kw: Any) -> Callable[[Sent], Answer]:
    return lambda sent: Answer(200, token_events(list(ids), **kw))


def error_of(answer: Whole | None) -> dict[str, Any]:
    assert answer is not None
    return json.loads(answer.body)["error"]


async def test_a_failing_worker_is_retried_on_the_next_and_its_breaker_counts(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    ws = workers(2)
    r = await make_router(ws, policy="round_robin")
    upstream.engine("http://w0", lambda s: Answer(503, [b'{"error": "busy"}'], {"Content-Type": "application/json"}))
    upstream.engine("http://w1", tokens(5, 6, usage=3))
    out = FakeClient()
    assert await vclock.run(r.completions(call(streamed([1, 2, 3], 2)), out)) is None
    assert out.token_ids() == [5, 6] and out.events()[-1] == "[DONE]"
    assert out.headers["X-Served-By"] == "w1"
    assert r.metrics.retries.value("upstream_failure") == 1
    assert ws[0].breaker.failures == 1 and ws[1].breaker.failures == 0
    usage = [e for e in out.events() if isinstance(e, dict) and e.get("usage")]
    assert usage[0]["usage"]["completion_tokens"] == 2 and usage[0]["id"] == "cmpl-e"


async def test_every_attempt_failing_is_a_502_naming_the_last_failure(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    r = await make_router(workers(3), max_attempts=2)  # no engine answers at all: connections refused
    answer = await vclock.run(r.completions(call(streamed([1, 2])), FakeClient()))
    assert answer is not None and answer.status == 502
    assert "connection refused" in error_of(answer)["message"]
    assert len({s.engine for s in upstream.sent}) == 0 and r.metrics.retries.value("upstream_failure") == 1


async def test_the_breaker_opens_after_consecutive_failures_and_lets_a_trial_through_after_cooldown(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    ws = workers(2)
    r = await make_router(ws, policy="round_robin", breaker_threshold=2, breaker_cooldown_s=5.0, max_attempts=2)
    upstream.engine("http://w1", tokens(9))
    for _ in range(3):
        await vclock.run(r.completions(call(streamed([1], 1)), FakeClient()))
    assert ws[0].breaker.state == "open" and r.metrics.breaker_opened.value("w0") == 1
    assert [w.name for w in r.chooser.eligible("m", None)] == ["w1"]
    vclock.t += 5001  # the cooldown passes
    assert [w.name for w in r.chooser.eligible("m", None)] == ["w0", "w1"]  # half-open: one trial
    upstream.engine("http://w0", tokens(4))
    for _ in range(2):
        await vclock.run(r.completions(call(streamed([1], 1)), FakeClient()))
    assert ws[0].breaker.state == "closed" and ws[0].breaker.failures == 0


async def test_saturation_is_a_429_with_retry_after_and_residency_a_503(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    ws = workers(2)
    r = await make_router(ws, max_waiting=4)
    for w in ws:
        w.waiting = 4
    answer = await vclock.run(r.completions(call(streamed([1])), FakeClient()))
    assert answer is not None and answer.status == 429 and answer.headers["Retry-After"] == "1"
    assert r.metrics.saturated.value() == 1
    ws[1].waiting = 3
    upstream.engine("http://w1", tokens(2))
    assert await vclock.run(r.completions(call(streamed([1], 1)), FakeClient())) is None
    answer = await vclock.run(r.completions(call(streamed([1]), **{"X-Residency": "eu-west-1"}), FakeClient()))
    assert answer is not None and answer.status == 503 and "residency region 'eu-west-1'" in error_of(answer)["message"]
    assert not upstream.to("http://w0")


async def test_a_request_past_its_deadline_gets_a_504_and_its_engine_request_is_aborted(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    r = await make_router(workers(1), request_timeout_s=2.0)
    upstream.engine("http://w0", lambda s: Answer(200, [STALL], {"Content-Type": "application/json"}))
    answer = await vclock.run(r.completions(call({"model": "m", "prompt": [1, 2]}), FakeClient()))
    assert answer is not None and answer.status == 504 and "deadline of 2 s" in error_of(answer)["message"]
    assert 2000 <= vclock.now_ms() <= 2100
    assert upstream.answered[0].aborted
    # A stream already begun ends with an error event and [DONE] instead.
    upstream.engine("http://w0", lambda s: Answer(200, [*token_events([3], finish=False), STALL]))
    out = FakeClient()
    assert await vclock.run(r.completions(call(streamed([1, 2])), out)) is None
    events = out.events()
    assert out.token_ids() == [3] and events[-2]["error"]["code"] == 504 and events[-1] == "[DONE]"
    assert upstream.answered[-1].aborted and r.metrics.responses.value("504") == 2


async def test_a_worker_dying_mid_stream_is_migrated_without_losing_or_repeating_a_token(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    ws = workers(2)
    r = await make_router(ws, policy="round_robin")
    broken = [*token_events([10, 11], finish=False), UpstreamError("the engine was silent past the read timeout")]
    upstream.engine("http://w0", lambda s: Answer(200, broken))
    upstream.engine("http://w1", tokens(12, 13, rid="cmpl-other", usage=7))
    out = FakeClient()
    assert await vclock.run(r.completions(call(streamed([1, 2, 3], 4)), out)) is None
    assert out.token_ids() == [10, 11, 12, 13]
    cont = upstream.to("http://w1")[0].body
    assert cont["prompt"] == [1, 2, 3, 10, 11] and cont["max_tokens"] == 2
    chunks = [e for e in out.events() if isinstance(e, dict) and e["choices"]]
    assert {c["id"] for c in chunks} == {"cmpl-e"}  # the continuation speaks in the original stream's identity
    usage = next(e for e in out.events() if isinstance(e, dict) and e.get("usage"))["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3, 4)
    assert out.events().count("[DONE]") == 1 and r.metrics.migrations.value("ok") == 1
    assert ws[0].breaker.failures == 1


async def test_migration_stays_in_the_residency_region_or_ends_the_stream_with_an_error(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    ws = workers(1, region="eu") + workers(1, region="us", prefix="u")
    r = await make_router(ws)
    upstream.engine("http://w0", lambda s: Answer(200, [*token_events([10], finish=False), UpstreamError("reset")]))
    upstream.engine("http://u0", tokens(11))
    out = FakeClient()
    await vclock.run(r.completions(call(streamed([1], 2), **{"X-Residency": "eu"}), out))
    assert out.token_ids() == [10] and out.events()[-2]["error"]["code"] == 502 and out.events()[-1] == "[DONE]"
    assert not upstream.to("http://u0") and r.metrics.migrations.value("failed") == 1


async def test_a_stream_cut_twice_goes_on_where_the_cluster_stands_then(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    ws = workers(3)
    r = await make_router(ws, policy="round_robin")
    ws[2].draining = True  # not eligible when the stream is first cut (a replacement joining, say)
    upstream.engine("http://w0", lambda s: Answer(200, [*token_events([10], finish=False), UpstreamError("reset")]))

    def w1(sent: Sent) -> Answer:
        ws[2].draining = False  # eligible by the time w1 breaks too
        return Answer(200, [*token_events([11], finish=False), UpstreamError("reset")])

    upstream.engine("http://w1", w1)
    upstream.engine("http://w2", tokens(12, 13, usage=6))
    out = FakeClient()
    await vclock.run(r.completions(call(streamed([1, 2, 3], 4)), out))
    assert out.token_ids() == [10, 11, 12, 13] and out.events()[-1] == "[DONE]"
    assert upstream.to("http://w2")[0].body["prompt"] == [1, 2, 3, 10, 11]
    assert r.metrics.migrations.value("ok") == 1


async def test_a_client_that_leaves_aborts_the_engines_request(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    ws = workers(1)
    r = await make_router(ws)
    upstream.engine("http://w0", tokens(1, 2, 3))
    out = FakeClient(leave_after=1)  # a write fails once the client is gone
    assert await vclock.run(r.completions(call(streamed([5], 3)), out)) is None
    assert upstream.answered[0].aborted and r.metrics.responses.value("499") == 1
    assert ws[0].breaker.failures == 0  # the client's leaving is not the engine's failure
    # A client that leaves while the engine is silent cancels the handler (aiohttp's handler_cancellation).
    upstream.engine("http://w0", lambda s: Answer(200, [*token_events([1], finish=False), STALL]))
    task = asyncio.get_running_loop().create_task(r.completions(call(streamed([5], 3)), FakeClient()))
    for _ in range(50):
        await asyncio.sleep(0)
    assert not task.done() and ws[0].inflight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert upstream.answered[1].aborted and ws[0].breaker.failures == 0


async def test_a_completed_stream_reads_its_engines_answer_to_the_end_and_a_left_one_does_not(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    # The engine's body ends after its [DONE] (the chunked end, a separate write): read to it, the connection
    # goes back to the pool (Upstream.drain); an engine answer the client left is closed unread (aborted).
    ws = workers(1)
    r = await make_router(ws)
    upstream.engine("http://w0", lambda s: Answer(200, [*token_events([1, 2]), b"data: {}\n\n"]))
    out = FakeClient()
    assert await vclock.run(r.completions(call(streamed([5], 2)), out)) is None
    assert out.token_ids() == [1, 2] and out.events()[-1] == "[DONE]"
    assert upstream.answered[0].drained and not upstream.answered[0].aborted
    assert await vclock.run(r.completions(call(streamed([5], 2)), FakeClient(leave_after=1))) is None
    assert not upstream.answered[1].drained and upstream.answered[1].aborted


async def test_a_stalled_engine_of_a_whole_answer_is_given_up_on_and_retried_elsewhere(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    """The read timeout itself is aiohttp's (see the integration test); here its error, mid-body."""
    ws = workers(2)
    r = await make_router(ws, policy="round_robin")
    upstream.engine("http://w0", lambda s: Answer(200, [b'{"id":', UpstreamError("silent past the read timeout")],
                                                  {"Content-Type": "application/json"}))
    upstream.engine("http://w1", lambda s: Answer(200, [b'{"id": "x", "usage": {"prompt_tokens": 2}}'],
                                                  {"Content-Type": "application/json"}))
    answer = await vclock.run(r.completions(call({"model": "m", "prompt": [1, 2]}), FakeClient()))
    assert answer is not None and answer.status == 200 and answer.headers["X-Served-By"] == "w1"
    assert r.metrics.prompt_tokens.value() == 2


async def test_a_remote_region_pays_the_emulated_round_trip(
        make_router: MakeRouter, upstream: FakeUpstream, vclock: VirtualClock) -> None:
    from cluster.router.app import RouterSite
    from cluster.router.regions import Topology

    ws = workers(1, region="eu")
    r = await make_router(ws, site=RouterSite(Topology({("us", "eu"): 75.0})), region="us")
    upstream.engine("http://w0", tokens(1))
    await vclock.run(r.completions(call(streamed([1], 1)), FakeClient()))
    assert vclock.now_ms() == 75.0 and r.metrics.cross_region.value("us", "eu") == 1


class _Watching(FakeUpstream):
    """Fake engines that note the prefill blocks owed on the workers when a request reaches them, before and after
    the router's ``sent`` callback."""

    def __init__(self, ws: list[WorkerInfo]) -> None:
        super().__init__()
        self.ws = ws
        self.owed: list[tuple[int, int]] = []

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: Mapping[str, str] | None = None,
                      sent: Callable[[], None] | None = None) -> FakeResponse:
        before = sum(w.prefilling_blocks for w in self.ws)
        if sent is not None:
            sent()
        self.owed.append((before, sum(w.prefilling_blocks for w in self.ws)))
        return await super().request(method, base_url, path, body, headers)


async def test_the_attempt_is_booked_once_its_request_is_on_its_way_before_any_other_task_runs(
        vclock: VirtualClock) -> None:
    """The engine gets the request before the router's bookkeeping of the attempt (the choice recorded, the blocks
    it owes), which the upstream's ``sent`` does before the loop runs anything else; no second request is decided
    without it (the second request, of another prompt, is decided knowing what the first owes)."""
    ws = workers(2)
    up = _Watching(ws)
    for w in ws:
        up.engine(w.url, tokens(5, 6, usage=64))
    r = RouterServer(ws, RouterSpec(index_mode="approximate", policy="kv_aware"), clock=vclock, upstream=up,
                     prefill_ms=lambda w, new, cached: new / 100.0)
    await r.start_mechanism()
    try:
        prompts = [list(range(1, 65)), list(range(101, 165))]  # 4 blocks of 16 each, none shared
        outs = [FakeClient(), FakeClient()]

        async def both() -> None:
            await asyncio.gather(*(r.completions(call(streamed(p, 2)), o) for p, o in zip(prompts, outs, strict=True)))

        await vclock.run(both())
        assert all(o.token_ids() == [5, 6] for o in outs)
        assert up.owed == [(0, 4), (4, 8)]  # each booked after its send; the second saw the first's
    finally:
        await r.stop_mechanism()
